"""One-step-delayed updates: overlap a step's push and pull with the next step's gradient.

This is the schedule of hivemind's delayed parameter updates. With ``w_t`` the server's
parameters after ``t`` updates and ``U`` the server's optimizer step, a worker computes its
gradient at the parameters it holds, which lag the server by one step::

    m_0 = m_1 = w_0,   m_{t+1} = w_t,   w_{t+1} = U(w_t, grad L(m_t))

so ``grad L(m_{t+1})`` (the caller's next forward and backward pass) runs while the push of
``grad L(m_t)`` and the pull of ``w_{t+1}`` are on the wire. The trajectory is exactly that
of a synchronous loop which pushes, waits, and keeps the previous result for one more step.

Imports neither jax nor torch: the adapters (``client/torch.py``, ``client/jax.py``) convert
their tensors to named NumPy arrays and back around :class:`DelayedStepper`.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Mapping, Optional, Protocol

import numpy as np

from optserve.client.errors import FutureBaseError


class _AsyncSession(Protocol):
    mode: str
    version: int

    def push_pull_async(self, grads: Mapping[str, np.ndarray], **kwargs: Any) -> concurrent.futures.Future: ...


class DelayedStepper:
    """Keeps at most one ``push_pull`` in flight and hands back the previous one's parameters.

    Args:
      session: anything with ``push_pull_async(grads, **kwargs) -> Future[dict[str, ndarray]]``
        (an ``optserve.client.Session``).

    The gradients given to :meth:`step` must not be modified until the next :meth:`step` or
    :meth:`wait` returns (the push reads them while the caller computes); pass copies if the
    caller reuses its gradient buffers.

    In async mode each push is stamped with the version of the parameters its gradient was
    computed from (one behind while a push is in flight), so the server measures its true
    staleness and ``max_staleness`` protects overlapping workers too. In sync mode the stamp is
    the step the push joins, which the session tracks itself.
    """

    def __init__(self, session: _AsyncSession):
        self._session = session
        self._in_flight: Optional[concurrent.futures.Future] = None
        # Version of the parameters the caller holds (and computes its next gradient on).
        self._held_version: Optional[int] = getattr(session, "version", None)
        self._stamps_base_version = getattr(session, "mode", "sync") == "async"

    @property
    def in_flight(self) -> bool:
        """Whether a push is on the wire whose parameters have not been handed back yet."""
        return self._in_flight is not None

    def step(self, grads: Mapping[str, np.ndarray], **push_kwargs: Any) -> Optional[dict[str, np.ndarray]]:
        """Waits for the previous push, starts pushing ``grads``, returns the previous result.

        Returns:
          The parameters the server returned for the previous :meth:`step` (``w_t`` above),
          or ``None`` on the first step, when the caller keeps its initial parameters.

        Raises:
          Whatever the previous push raised (its error surfaces one step late).
        """
        base_version = self._held_version
        previous = self.wait()
        if self._stamps_base_version and base_version is not None:
            push_kwargs.setdefault("base_version", base_version)
        self._in_flight = self._session.push_pull_async(grads, **push_kwargs)
        return previous

    def wait(self) -> Optional[dict[str, np.ndarray]]:
        """Blocks until the push in flight (if any) completes and returns its parameters."""
        future, self._in_flight = self._in_flight, None
        if future is None:
            return None
        try:
            params = future.result()
        except FutureBaseError:  # stamped with a version a restore rolled back: hold the session's now
            self._held_version = getattr(self._session, "version", None)
            raise
        self._held_version = getattr(self._session, "version", None)
        return params
