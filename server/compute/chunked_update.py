"""A shard's step, as jitted programs over chunks of its tensors: one chunk for most shards, many
for a shard with thousands of tensors (compile cost that grows with shapes, not tensors).

XLA's compile time of one step over a whole pytree grows faster than the tensor count (a few
hundred tensors compile in seconds, a few thousand in minutes). A shard holding more than
:data:`CHUNK_TENSORS` tensors is therefore updated chunk by chunk: its tensors sorted by (rank,
shape, dtype, name) and cut into chunks of at most that many. Every other shard is one chunk of all
its tensors (``chunk_tensors`` 0), whose state is the optimizer's state of the whole tree. Each
chunk's step, partial statistic, masked step and state init is one jitted function over *flat*
tuples of arrays (the tensor names live in the traced function, so kernels that read paths, such
as T5X's factor rules, see them).

Executables are shared through :data:`~optserve.server.compute.compile_cache.EXECUTABLES`
(process-wide, so sessions share them): found by the chunk's structure (a second session of a
model compiles nothing), else by the hash of the program's text (chunks of other names whose
programs are identical: a model of thousands of tensors of a few shapes compiles a few programs;
only tracing is per tensor).

Semantics are those of the whole-tree step: the tensors of a session are already split across
shards, each running the optimizer over its part and summing the partial statistic; a chunk is one
more such part (its partial statistics are summed with the shard's). The optimizer state of a
shard of several chunks is the tuple of its chunks' states (checkpoints record the chunk size, see
:attr:`~optserve.server.domain.durability.ShardProgress.state_chunks`).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

import numpy as np

from optserve.server.compute.compile_cache import EXECUTABLES

CHUNK_TENSORS = 64
"""A shard with more tensors than this is updated in chunks of at most this many."""


def plan_chunks(specs: Mapping[str, tuple], chunk_tensors: int) -> list[tuple[str, ...]]:
    """The chunks of tensors ``specs`` (name -> (shape, dtype)), each of at most ``chunk_tensors``
    names in name order: the tensors of each (shape, dtype) cut into full chunks of their own (one
    program for all of them), what is left of every kind then cut together, sorted by (rank,
    shape, dtype, name). Deterministic: a restore plans the chunks a checkpoint was written in.
    ``chunk_tensors`` 0: one chunk of every tensor."""
    if not chunk_tensors:
        return [tuple(sorted(specs))] if specs else []
    def kind(name):
        return len(specs[name][0]), tuple(specs[name][0]), np.dtype(specs[name][1]).str

    by_kind: dict[tuple, list[str]] = {}
    for name in sorted(specs, key=lambda n: (kind(n), n)):
        by_kind.setdefault(kind(name), []).append(name)
    chunks, rest = [], []
    for names in by_kind.values():
        full = len(names) - len(names) % chunk_tensors
        chunks += [tuple(names[i:i + chunk_tensors]) for i in range(0, full, chunk_tensors)]
        rest += names[full:]
    chunks += [tuple(sorted(rest[i:i + chunk_tensors])) for i in range(0, len(rest), chunk_tensors)]
    return chunks


def strongly_typed(tree):
    """``tree`` with no weakly typed leaf (dtypes kept), so the state a step returns has the
    types of the state it was given and one compiled program serves every step."""
    import jax
    from jax import lax

    return jax.tree.map(lambda leaf: lax.convert_element_type(leaf, leaf.dtype), tree)


class ChunkedUpdate:
    """The step of one optimizer over a shard's tensors, chunk by chunk.

    Args:
      optimizer: the ``BuiltOptimizer``.
      step: ``step(params, state, grads, scale, global_stat, hyper) -> (params, state)`` over a
        dict of tensors (:func:`~optserve.server.compute.updater.step_function`).
      masked: the same with a last argument ``keep`` (name -> bool: tensor left alone).
      chunks: the tensor names of each chunk (:func:`plan_chunks`).
      key: the optimizer's cache key prefix (None: nothing is shared by structure).
      whole: the chunks are one chunk of every tensor, whose state is the optimizer's state of
        the whole tree (as the optimizer's own ``init`` makes it).

    The state is the optimizer state of the whole tree, or (not ``whole``) a tuple with one
    optimizer state per chunk. Not thread-safe (the updater's caller serialises).
    """

    def __init__(self, optimizer, step: Callable, masked: Callable, chunks: Sequence[tuple[str, ...]],
                 key: Optional[Hashable], whole: bool = False):
        self.optimizer = optimizer
        self.chunks = [tuple(c) for c in chunks]
        if whole and len(self.chunks) != 1:
            raise ValueError(f"a whole-tree update is one chunk, got {len(self.chunks)}")
        self.whole = whole
        self._step, self._masked, self._key = step, masked, key
        self._programs: list[dict[str, Any]] = [{} for _ in self.chunks]  # per chunk: kind -> executable
        self._state_defs: list[Any] = [None] * len(self.chunks)

    def _split(self, states) -> Sequence[Any]:
        """Each chunk's state, from the state as the updater holds it."""
        return (states,) if self.whole else states

    def _joined(self, states: Sequence[Any]):
        """The state as the updater holds it, from each chunk's state."""
        return states[0] if self.whole else tuple(states)

    # ------------------------------------------------------------------ keys and lowering
    def _structure_key(self, kind: str, index: int, args) -> Optional[tuple]:
        if self._key is None:
            return None
        import jax

        avals = tuple((tuple(np.shape(x)), str(getattr(x, "dtype", np.asarray(x).dtype)),
                       bool(getattr(x, "weak_type", False))) for x in jax.tree.leaves(args))
        return self._key, kind, self.chunks[index], avals

    def _program(self, kind: str, index: int, function: Callable, args, donate=(), fresh: bool = False):
        """The executable of ``function`` (over flat tuples) for chunk ``index`` and ``args``.

        Lowered with every input kept (``keep_unused``): an executable picks its arguments by the
        inputs it kept, which its text need not show, so two chunks reading different inputs (the
        hyperparameters of different parameter groups) must not share one through equal texts."""
        import jax

        programs = self._programs[index]
        if fresh or kind not in programs:
            programs[kind] = EXECUTABLES.compiled_for(
                self._structure_key(kind, index, args),
                lambda: jax.jit(function, donate_argnums=donate, keep_unused=True).lower(*args), fresh=fresh)
        return programs[kind]

    def _call(self, kind: str, index: int, function: Callable, args, donate=()):
        """Runs chunk ``index``'s ``kind`` program; lowers it again once if the arguments' types
        moved (a state whose dtypes a step changes)."""
        try:
            return self._program(kind, index, function, args, donate)(*args)
        except TypeError:
            return self._program(kind, index, function, args, donate, fresh=True)(*args)

    # ------------------------------------------------------------------ the functions, flat
    def _init_function(self, index: int) -> Callable:
        import jax

        names = self.chunks[index]

        def init(params):
            state = strongly_typed(self.optimizer.transformation.init(dict(zip(names, params))))
            leaves, self._state_defs[index] = jax.tree.flatten(state)
            return leaves
        return init

    def _step_function(self, index: int, masked: bool) -> Callable:
        import jax

        names, state_def = self.chunks[index], self._state_defs[index]

        def step(params, state, grads, scale, global_stat, hyper, *keep):
            args = (dict(zip(names, params)), state_def.unflatten(state), dict(zip(names, grads)),
                    scale, global_stat, hyper)
            if masked:
                new_params, new_state = self._masked(*args, dict(zip(names, keep[0])))
            else:
                new_params, new_state = self._step(*args)
            return tuple(new_params[n] for n in names), jax.tree.leaves(strongly_typed(new_state))
        return step

    def _partial_function(self, index: int) -> Callable:
        names, state_def = self.chunks[index], self._state_defs[index]
        partial = self.optimizer.partial_statistic

        def total(grads, state, params):
            import jax

            grads = dict(zip(names, grads))
            params = dict(zip(names, params))
            return partial(jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params),
                           state_def.unflatten(state), params)
        return total

    def _evaluation_function(self, index: int) -> Callable:
        names, state_def = self.chunks[index], self._state_defs[index]
        evaluation = self.optimizer.evaluation

        def evaluate(state, params):
            out = evaluation(state_def.unflatten(state), dict(zip(names, params)))
            return tuple(out[n] for n in names)
        return evaluate

    # ------------------------------------------------------------------ what the updater calls
    def init(self, params: Mapping[str, Any]):
        """The optimizer state for ``params`` (name -> device array)."""
        import jax

        states = []
        for index, names in enumerate(self.chunks):
            args = (tuple(params[n] for n in names),)
            leaves = self._call("init", index, self._init_function(index), args)
            if self._state_defs[index] is None:  # a shared executable: trace once for the structure
                jax.eval_shape(self._init_function(index), *args)
            states.append(self._state_defs[index].unflatten(leaves))
        return self._joined(states)

    def adopt(self, states) -> None:
        """Learns each chunk's state structure from ``states`` (restored from a checkpoint)."""
        import jax

        for index, state in enumerate(self._split(states)):
            self._state_defs[index] = jax.tree.structure(state)

    def abstract_state(self, params: Mapping[str, Any]):
        """The state as ``jax.ShapeDtypeStruct`` (a checkpoint restores into it)."""
        import jax

        return self._joined([jax.eval_shape(lambda p: strongly_typed(self.optimizer.transformation.init(p)),
                                            {n: params[n] for n in names}) for names in self.chunks])

    def compile_ahead(self, params: Mapping[str, Any], states, hyper) -> None:
        """Compiles every chunk's step (and partial statistic) for these shapes now (``params``:
        arrays or ``jax.ShapeDtypeStruct``; ``states``: the state, or None for the one ``init``
        makes)."""
        import jax

        if states is None:  # init traced once per chunk: its state, and the structure each step unflattens
            traced = []
            for index, names in enumerate(self.chunks):
                leaves = jax.eval_shape(self._init_function(index), tuple(params[n] for n in names))
                traced.append(self._state_defs[index].unflatten(leaves))
            states = self._joined(traced)
        scalar, hyper = jax.ShapeDtypeStruct((), np.float32), _float32(hyper)
        for index, state in enumerate(self._split(states)):
            names = self.chunks[index]
            ps = tuple(jax.ShapeDtypeStruct(params[n].shape, params[n].dtype) for n in names)
            gs = tuple(jax.ShapeDtypeStruct(params[n].shape, np.float32) for n in names)
            leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
                      for x in jax.tree.leaves(state)]
            self._program("step", index, self._step_function(index, False),
                          (ps, leaves, gs, scalar, scalar, hyper), donate=(0, 1))
            if self.optimizer.partial_statistic is not None:
                self._program("partial", index, self._partial_function(index), (gs, leaves, ps))

    def working_bytes(self, params: Mapping[str, Any], hyper) -> Optional[int]:
        """Bytes of XLA temporaries one step allocates beyond its inputs and outputs (its compiled
        program's ``memory_analysis().temp_size_in_bytes``; for Shampoo with its roots computed
        inside the step, several times the parameters), for ``params`` (``jax.ShapeDtypeStruct``):
        the step compiled now is the one the steps run. None for several chunks (programs of a
        part of the tensors each) or when the step cannot be compiled (the step reports why)."""
        if len(self.chunks) != 1:
            return None
        try:
            self.compile_ahead(params, None, hyper)
            return int(self._programs[0]["step"].memory_analysis().temp_size_in_bytes)
        except Exception:  # noqa: BLE001 - the step's own failure is reported where it runs
            return None

    def partial(self, grads: Mapping[str, Any], states, params: Mapping[str, Any]) -> float:
        """The shard's partial statistic: the sum of its chunks'."""
        import jax

        parts = []
        for index, state in enumerate(self._split(states)):
            names = self.chunks[index]
            args = (tuple(grads[n] for n in names), jax.tree.leaves(state), tuple(params[n] for n in names))
            parts.append(self._call("partial", index, self._partial_function(index), args))
        # One wait for all of them (the chunks' programs run back to back), summed in float64.
        return float(np.sum(np.asarray(jax.device_get(parts), dtype=np.float64)))

    def step(self, params: dict, states, grads: Mapping[str, Any], scale, global_stat, hyper,
             absent: frozenset = frozenset()) -> tuple[dict, Any]:
        """One step of every chunk (tensors in ``absent`` left alone, as the masked step leaves
        them). Donates ``params``' arrays and ``states``; returns the new ones."""
        import jax

        new_params, new_states, hyper = dict(params), [], _float32(hyper)
        for index, state in enumerate(self._split(states)):
            names = self.chunks[index]
            args = (tuple(params[n] for n in names), jax.tree.leaves(state),
                    tuple(grads[n] for n in names), scale, global_stat, hyper)
            keep = tuple(np.bool_(n in absent) for n in names)
            if any(keep):
                out_params, out_state = self._call("masked", index, self._step_function(index, True),
                                                   args + (keep,), donate=(0, 1))
            else:
                out_params, out_state = self._call("step", index, self._step_function(index, False),
                                                   args, donate=(0, 1))
            new_params.update(zip(names, out_params))
            new_states.append(self._state_defs[index].unflatten(out_state))
        return new_params, self._joined(new_states)

    def evaluation(self, states, params: Mapping[str, Any]) -> dict:
        """The optimizer's evaluation parameters (schedule-free), chunk by chunk (chunks of one
        program share its executable, as their steps do)."""
        import jax

        out: dict = {}
        for index, state in enumerate(self._split(states)):
            names = self.chunks[index]
            args = (jax.tree.leaves(state), tuple(params[n] for n in names))
            out.update(zip(names, self._call("evaluation", index, self._evaluation_function(index), args)))
        return out


def _float32(hyper: Mapping[str, Mapping[str, Any]]) -> dict:
    """``hyper`` (``{group: {option: number}}``) with float32 scalars: every step's program takes
    the same argument types, whether a value came from the optimizer or from a caller."""
    return {group: {option: np.float32(value) for option, value in values.items()} for group, values in hyper.items()}
