"""What a session's part is estimated to hold in a shard's memory, before the shard holds anything:
the figure the shard memory budget (``--shard-memory-bytes``) admits or refuses a session by."""

from __future__ import annotations

import dataclasses
from typing import Iterable

from optserve.server.compute.kernels import compiled_step_bytes, traced_bytes
from optserve.server.domain.config import SessionConfig

# When the optimizer's state cannot be traced for the tensors (the shard will refuse the session,
# naming why), it is counted as this many float32 copies of the parameters.
FALLBACK_STATE_COPIES = 3


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Host bytes of one session's part on one shard.

    Attributes:
      params: the parameters as stored.
      state: the optimizer's state for these tensors, as its ``init`` builds it (traced
        abstractly: :func:`~optserve.server.compute.kernels.traced_bytes`).
      gradients: one float32 gradient buffer (what a push stages).
      roots: statistics and roots in flight while matrix roots are exchanged with preconditioner
        workers (Shampoo, SOAP: :func:`~optserve.server.compute.kernels.traced_bytes`; 0 for
        other optimizers, and for roots computed inside the step, whose memory is the step's
        working memory, measured by the shard at create).
      code: the compiled step of a blocked update (Shampoo, SOAP), which grows with the blocks
        (:func:`~optserve.server.compute.kernels.compiled_step_bytes`; 0 for other optimizers).
    """

    params: int
    state: int
    gradients: int
    roots: int = 0
    code: int = 0

    @property
    def total(self) -> int:
        return self.params + self.state + self.gradients + self.roots + self.code

    def describe(self) -> str:
        roots = f", {self.roots} of preconditioner roots in flight" if self.roots else ""
        code = f", {self.code} of compiled step" if self.code else ""
        return (f"{self.total} bytes ({self.params} of parameters, {self.state} of optimizer state, "
                f"{self.gradients} of gradient buffer{roots}{code})")


def estimate(config: SessionConfig, names: Iterable[str], workers: bool) -> MemoryEstimate:
    """The estimate for the tensors ``names`` of session ``config`` on one shard; ``workers``: the
    server has preconditioner workers (roots are exchanged unless the session computes them in
    process)."""
    by_name = config.spec_by_name
    specs = [by_name[name] for name in names]
    elements = sum(spec.size for spec in specs)
    shapes = {spec.name: spec.shape for spec in specs}
    state, roots = traced_bytes(config.optimizer_name, config.optimizer_args, shapes)
    offloaded = workers and not config.preconditioners.in_process
    return MemoryEstimate(params=sum(spec.nbytes for spec in specs),
                          state=FALLBACK_STATE_COPIES * 4 * elements if state is None else state,
                          gradients=4 * elements,
                          roots=roots if offloaded else 0,
                          code=compiled_step_bytes(config.optimizer_name, config.optimizer_args, shapes,
                                                   roots_in_step=not offloaded))
