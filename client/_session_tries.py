"""One try of a session's push or push_pull on the wire, for :class:`~optserve.client._session.Session`.

A push is prepared once (:meth:`SessionTries.header`, :meth:`SessionTries.encode`) and then tried
(:meth:`SessionTries.push_once`, :meth:`SessionTries.push_pull_once`) as often as the session's
retry loop (:meth:`optserve.client._fanout.ShardFanout.served`) asks: every try resends the same
header (client id and sequence number, so the server applies the push at most once) under the
next ``attempt``, and the same bytes. Each answered try tells the session the version and the
staleness the server assigned.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Mapping, Optional, Union

import numpy as np

from optserve.client._inputs import add_telemetry
from optserve.client.errors import InvalidArgumentError
from optserve.protos import contract
from optserve.protos.sparse_codec import SparseGradient
from optserve.protos.optserve.v1 import data_pb2


class SessionTries:
    """The tries of one session object's pushes.

    Args:
      session: the session they are for: its name, push identity (``client_id``), latest version,
        client (the call timeout), data paths and int8 error feedback are read at each call; each
        answered try sets its ``last_staleness`` and the version it has seen.
    """

    def __init__(self, session: Any):  # the Session that owns this object (it imports this module)
        self._session = session
        self._sequence = itertools.count(1)  # each push's sequence number (its retries reuse it)

    def header(self, base_version: Optional[int] = None, loss: Optional[float] = None,
               scalars: Optional[Mapping[str, float]] = None, without_gradient: Iterable[str] = ()) -> data_pb2.PushHeader:
        session = self._session
        base = session.version if base_version is None else int(base_version)
        header = data_pb2.PushHeader(session=session.name, client_id=session.client_id, sequence=next(self._sequence),
                                     base_version=base, auto_commit=True, wait_s=session._client.timeout,
                                     without_gradient=sorted(without_gradient),
                                     incarnation=session.info.config.incarnation)
        return add_telemetry(header, loss, scalars)

    def encode(self, grads: dict[str, np.ndarray], wire: Optional[int]) -> dict:
        """int8: the gradients quantized once per push (retries resend the same bytes), with
        this object's error feedback; sparse: SparseLoCo selections already (DiLoCo's compression
        makes them); other wire dtypes are converted per chunk."""
        if wire == contract.SPARSE:
            dense = sorted(name for name, grad in grads.items() if not isinstance(grad, SparseGradient))
            if dense:
                raise InvalidArgumentError(f"wire dtype sparse carries SparseLoCo selections only; tensors {dense[:5]} "
                                           f"are arrays (DiLoCo's compression='sparseloco' makes them)")
            return grads
        return self._session._feedback.quantize(grads) if wire == contract.INT8 else grads

    def push_once(self, header: data_pb2.PushHeader, grads: Mapping, wire: Optional[int]) -> int:
        """One attempt: every shard stages its part and commits with its peers (auto_commit);
        returns the new version."""
        session = self._session
        header.attempt += 1  # each try is voted on apart by the shards
        responses = session._paths.push(header, grads, wire)
        version = max(r.version for r in responses)
        session.last_staleness = responses[0].staleness
        session._see_version(version)
        return version

    def push_pull_once(self, header: data_pb2.PushHeader, grads: Mapping, wire: Optional[int],
                       out: Optional[Mapping[str, np.ndarray]] = None, views: bool = False,
                       reply: bool = True, sparse_base: Optional[tuple] = None) -> Union[int, dict[str, np.ndarray]]:
        """One attempt: push (auto_commit) and receive the step's parameters, per shard: returns
        them (name -> array), or the new version alone when not ``reply`` (a push through
        shared memory). ``sparse_base``: see ``Session.push_pull``."""
        session = self._session
        header.attempt += 1  # each try is voted on apart by the shards
        base = sparse_base[1] if sparse_base is not None and sparse_base[0] == header.base_version else None
        replies = session._paths.push_pull(header, grads, wire, out, views, reply, sparse_base=base)
        session.last_received_bytes = sum(r.received_bytes for r in replies)
        session.last_staleness = replies[0].done.staleness
        session._see_version(min(r.done.version for r in replies))
        # the version the gradient went into: earlier than the parameters' for a retry of a push applied before
        session.last_applied_version = max(r.done.applied_version or r.done.version for r in replies)
        if not reply:
            return session.last_applied_version
        return {name: value for r in replies for name, value in r.arrays.items()}
