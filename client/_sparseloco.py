"""DiLoCo's SparseLoCo compression on the worker: error feedback, then the top entries of each chunk.

Each exchange, per tensor, the worker's error buffer takes the pseudo-gradient in,
``e = error_decay * e + pseudo_gradient``; of each chunk of ``e`` the ``topk`` entries of largest
magnitude are sent, their values quantised to ``bits`` bits
(:mod:`optserve.protos.sparse_codec` has the chunks, the quantiser and the wire format), and what
was sent, as the server decodes it, leaves the buffer: ``e -= decode(sent)``. What a round does
not send stays in the buffer for the next.

The server decodes each worker's part (zeros where an entry was not sent) and its sync step
takes, per entry, the mean over the round's workers that sent it (``aggregation="senders"``,
SparseLoCo's) or over all of them (``"all"``); the session's outer optimizer then updates the
shared parameters (SparseLoCo uses SGD at learning rate 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import numpy as np

from optserve.client.errors import InvalidArgumentError
from optserve.protos import sparse_codec

NAME = "sparseloco"
AGGREGATIONS = ("senders", "all")


@dataclasses.dataclass(frozen=True)
class SparseLoCo:
    """DiLoCo's ``compression={"name": "sparseloco", ...}`` options.

    ``topk``: entries sent per chunk (at most the chunk's size); ``chunk``: a matrix's tiles are
    ``chunk x chunk``, anything else's pieces ``chunk`` elements (1..256); ``bits``: per value,
    1-8, or 32 for float32 values unquantised; ``error_decay``: in [0, 1], the error buffer's decay
    per exchange; ``aggregation``: the server's mean of each entry over the round's workers that
    sent it ("senders", as SparseLoCo), or over all the round's workers ("all": an entry a worker
    did not send counts as its zero); it is the session's ``sparse_mean`` option.
    """

    topk: int = 64
    chunk: int = 64
    bits: int = 2
    error_decay: float = 0.95
    aggregation: str = "senders"

    def __post_init__(self):
        def whole(name: str, value: Any, low: int, high: int) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise InvalidArgumentError(f"compression {NAME!r}: {name} must be an int from {low} to {high}, "
                                           f"got {value!r}")

        whole("chunk", self.chunk, 1, sparse_codec.MAX_CHUNK)
        whole("topk", self.topk, 1, self.chunk * self.chunk)
        if self.bits not in sparse_codec.VALUE_BITS:
            raise InvalidArgumentError(f"compression {NAME!r}: bits must be one of {sparse_codec.VALUE_BITS}, "
                                       f"got {self.bits!r}")
        if isinstance(self.error_decay, bool) or not isinstance(self.error_decay, (int, float)) \
                or not 0.0 <= float(self.error_decay) <= 1.0:
            raise InvalidArgumentError(f"compression {NAME!r}: error_decay must be a number in [0, 1], "
                                       f"got {self.error_decay!r}")
        if self.aggregation not in AGGREGATIONS:
            raise InvalidArgumentError(f"compression {NAME!r}: aggregation must be one of "
                                       f"{', '.join(map(repr, AGGREGATIONS))}, got {self.aggregation!r}")

    @classmethod
    def from_spec(cls, spec: Optional[Mapping[str, Any]]) -> Optional["SparseLoCo"]:
        """``None`` (no compression) or ``{"name": "sparseloco", option: value, ...}``."""
        if spec is None:
            return None
        if not isinstance(spec, Mapping) or spec.get("name") != NAME:
            raise InvalidArgumentError(f"compression must be None or a dict with name {NAME!r}, got {spec!r}")
        options = {k: v for k, v in spec.items() if k != "name"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidArgumentError(f"compression {NAME!r}: unknown option {unknown[0]!r} (options: "
                                       f"{', '.join(sorted(known))})")
        return cls(**options)


class ErrorFedSparsifier:
    """The worker's error buffers (one float32 array per tensor) and the compression of a round's
    pseudo-gradient (see the module docstring)."""

    def __init__(self, options: SparseLoCo):
        self.options = options
        self.errors: dict[str, np.ndarray] = {}
        self._sent: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # tensor -> (positions, values before sending)

    def compress(self, pseudo_gradient: Mapping[str, np.ndarray]) -> dict[str, sparse_codec.SparseGradient]:
        """Each tensor's selection; its error buffer keeps what was not sent (and, until
        :meth:`unsend`, what the sent entries held). Large pseudo-gradients are compressed a tensor
        per thread (:func:`~optserve.protos.sparse_codec.tensor_map`); the result is the same."""
        items = [(name, np.asarray(delta, np.float32)) for name, delta in pseudo_gradient.items()]
        selections = sparse_codec.tensor_map(lambda item: self._compress_one(*item), items,
                                             [delta.size for _, delta in items])
        return {name: selection for (name, _), selection in zip(items, selections)}

    def _compress_one(self, name: str, delta: np.ndarray) -> sparse_codec.SparseGradient:
        opts = self.options
        error = self.errors.get(name)
        if error is None or error.shape != delta.shape:
            error = self.errors[name] = delta.copy()
        else:
            error *= np.float32(opts.error_decay)
            error += delta
        selection = sparse_codec.encode(error, opts.chunk, opts.topk, opts.bits)
        positions, flat = selection.positions(), error.reshape(-1)
        self._sent[name] = (positions, flat[positions])
        flat[positions] -= selection.decoded()
        return selection

    def unsend(self, names) -> None:
        """The last selections of ``names`` were never applied (the push failed, or an elastic
        session dropped it as late): their entries go back into the error buffers as they were."""
        for name in names:
            sent = self._sent.pop(name, None)
            if sent is not None:
                self.errors[name].reshape(-1)[sent[0]] = sent[1]

    def state(self) -> dict[str, np.ndarray]:
        """Copies of the error buffers (for a worker's checkpoint)."""
        return {name: error.copy() for name, error in self.errors.items()}

    def load_state(self, errors: Mapping[str, np.ndarray]) -> None:
        self.errors = {name: np.array(error, np.float32) for name, error in errors.items()}
