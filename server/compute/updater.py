"""A session's parameters and optimizer state on one shard, and the one jitted step over them.

The shard's tensors form ONE pytree (a dict name -> array) on the shard's JAX device; each step
is one jitted, donated call over the whole pytree, plus one jitted partial-statistic call when
the optimizer needs a cross-shard sum. Shampoo sessions whose roots are offloaded call their
:class:`~optserve.server.compute.root_offload.ShardPreconditioners` right before and after it.
The updater knows nothing of versions, tickets or clients: the domain's shard session decides
*what* to apply; this module applies it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np


class Updater:
    """Parameters + optimizer state of one session's tensors on one shard (not thread-safe:
    the shard session serialises calls).

    Args:
      optimizer: the ``BuiltOptimizer`` to run (built once for this shard).
      preconditioners: Shampoo's per-shard root handling, or None.
      param_specs: name -> (shape, dtype) of the shard's tensors (needed to restore a checkpoint).
    """

    def __init__(self, optimizer, preconditioners=None, param_specs: Optional[Mapping[str, tuple]] = None):
        import jax

        self.optimizer = optimizer
        self.preconditioners = preconditioners
        self._param_specs = dict(param_specs or {})
        self.device = jax.devices()[0]
        self.params: Optional[dict[str, Any]] = None
        self.opt_state: Any = None
        self._step_fn, self._partial_fn = self._compile()

    def _compile(self):
        import jax
        import optax

        tx = self.optimizer.transformation
        partial = self.optimizer.partial_statistic

        def step(params, state, grads, scale, global_stat):
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            if partial is None:
                updates, state = tx.update(grads, state, params)
            else:
                updates, state = tx.update(grads, state, params, global_grad_sq_norm=global_stat)
            updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
            return optax.apply_updates(params, updates), state

        step_fn = jax.jit(step, donate_argnums=(0, 1))
        partial_fn = None
        if partial is not None:
            partial_fn = jax.jit(lambda grads, state, params: partial(
                jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), state, params))
        return step_fn, partial_fn

    @property
    def initialized(self) -> bool:
        return self.params is not None

    def initialize(self, values: Mapping[str, np.ndarray]) -> None:
        """Installs initial parameters (name -> array in the tensor's dtype) and the optimizer's state."""
        import jax

        params = {name: jax.device_put(value, self.device) for name, value in values.items()}
        self.opt_state = jax.jit(self.optimizer.transformation.init)(params)
        self.params = params

    def abstract_state(self) -> dict:
        """``{"params", "opt_state"}`` as ``jax.ShapeDtypeStruct`` trees (what a checkpoint restores into)."""
        import jax

        params = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in self._param_specs.items()}
        return {"params": params, "opt_state": jax.eval_shape(self.optimizer.transformation.init, params)}

    def restore(self, params: Mapping[str, np.ndarray], opt_state: Any) -> None:
        """Installs parameters and optimizer state read back from a checkpoint (host arrays)."""
        import jax

        self.params = {name: jax.device_put(np.asarray(value), self.device) for name, value in params.items()}
        self.opt_state = jax.tree.map(lambda x: jax.device_put(np.asarray(x), self.device), opt_state)

    def apply(self, grads: Mapping[str, np.ndarray], scale: float, reduce: Callable[[float], float]) -> float:
        """One update with float32 ``grads`` (name -> array, the shard's tensors), scaled by ``scale``.

        ``reduce(partial) -> total``: sums this shard's partial statistic over the session's
        shards (called only when the optimizer has one; a replay passes the logged total back).
        Returns the total used (0.0 without one) once the new parameters exist; ``grads`` may be
        reused by the caller afterwards.
        """
        import jax

        # may_alias: on CPU the jitted step reads the pooled host buffers directly (no copy); they
        # return to the pool only after the step completed (block_until_ready below).
        grads = {name: jax.device_put(g, self.device, may_alias=True) for name, g in grads.items()}
        global_stat = np.float32(0.0)
        if self._partial_fn is not None:
            global_stat = np.float32(reduce(float(self._partial_fn(grads, self.opt_state, self.params))))
        if self.preconditioners is not None:  # installs roots that arrived; waits past the age bound
            self.opt_state = self.preconditioners.before_update(self.opt_state, grads, self.params)
        self.params, self.opt_state = self._step_fn(self.params, self.opt_state, grads, np.float32(scale), global_stat)
        jax.block_until_ready(self.params)
        if self.preconditioners is not None:  # sends the statistics for new roots, without waiting
            self.opt_state = self.preconditioners.after_update(self.opt_state)
        return float(global_stat)

    def param_bytes(self) -> int:
        return _tree_bytes(self.params)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state's arrays (0 before initialization)."""
        return _tree_bytes(self.opt_state)

    def host_params(self) -> dict[str, np.ndarray]:
        """Host views of the parameters (no copy on CPU). Drop them before the next :meth:`apply`:
        a view that is still alive stops the update from donating (reusing) its buffer."""
        return {name: np.asarray(p) for name, p in self.params.items()}


def _tree_bytes(tree) -> int:
    import jax

    return sum(int(getattr(leaf, "nbytes", 0)) for leaf in jax.tree.leaves(tree)) if tree is not None else 0
