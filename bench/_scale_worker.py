"""The processes of :mod:`bench.scale`: one in-process kernel, or one training client per path.

Each runs in a process of its own (``multiprocessing`` spawn), so that its resident memory is its
own, and answers commands from the bench over a pipe: ``(command, kwargs)`` in, ``("ok", value)``
or ``("error", text)`` out. Commands:

* ``ready``: ``{"rss": bytes}`` after the imports (the process's fixed cost, before any model);
* ``setup``: builds the model (and, for a client, creates or attaches to the session): ``{"setup_s",
  "create_s", ...}``;
* ``step``: one timed step, returns its seconds (gradient preparation outside the timing);
* ``steps``: ``n`` steps back to back (the workers sweep), returns their wall seconds;
* ``memory``: ``{"rss", "hwm"}`` of this process, bytes (``VmRSS``, ``VmHWM``);
* ``profile``: ``n`` steps under cProfile, returns the top of the cumulative listing;
* ``stop``: detaches and exits.

Roles (``Role``): ``kernel`` (the optimizer's jitted, donated step on one device, as the shards run
it: Shampoo with ``{"in_process": false}`` without its inline roots), ``numpy`` (plain dicts,
``push_pull(grads)``, new arrays each step), ``views`` (``gradient_buffers()`` +
``push_pull(bufs, views=True)``) and ``torch`` (``RemoteOptimizer`` over a ``ParameterDict``;
``.grad`` accumulated in place as backward does, ``opt.zero_grad()`` from the optimizer).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

Shapes = Sequence[tuple[str, tuple[int, ...]]]


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssShmem`` of a process from ``/proc/PID/status``, bytes."""
    wanted = ("VmRSS", "VmHWM", "RssAnon", "RssShmem")
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in wanted:
                out[key] = int(value.split()[0]) * 1024
    return out


def numpy_model(shapes: Shapes, seed: int, scale: float, into: Mapping[str, Any] | None = None):
    """``{name: float32 array}`` of standard normals times ``scale``, written into ``into``'s
    arrays where given (no array of its own then)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    model = {}
    for name, shape in shapes:
        array = rng.standard_normal(shape, dtype=np.float32, out=None if into is None else into[name])
        array *= scale
        model[name] = array
    return model


def _distinct_buffers(params, state):
    """``state`` with every leaf that shares a buffer with an earlier leaf (or a parameter) copied:
    a donated argument may not hold one buffer twice (Shampoo's initial state shares some)."""
    import jax
    import jax.numpy as jnp

    seen = {leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(params)}

    def distinct(leaf):
        if not isinstance(leaf, jax.Array):
            return leaf
        pointer = leaf.unsafe_buffer_pointer()
        if pointer in seen:
            return jnp.copy(leaf)
        seen.add(pointer)
        return leaf

    return jax.tree.map(distinct, state)


def _kernel_optimizer(optimizer: Mapping[str, Any]):
    """The built optimizer a shard runs for ``optimizer`` (without inline roots where they are
    computed elsewhere)."""
    from optserve.optim_kernels import build_optimizer
    from optserve.optim_kernels.registry import optimizer_entry

    args = dict(optimizer.get("args") or {})
    offload = optimizer_entry(optimizer["name"]).root_offload
    if offload is not None and not (optimizer.get("preconditioners") or {}).get("in_process", True):
        args = offload.without_inline_roots(args)
    return build_optimizer(optimizer["name"], args)


class WholeTreeKernel:
    """The in-process baseline: ``optimizer``'s jitted step over the whole tree, params and state
    donated."""

    def __init__(self, shapes: Shapes, optimizer: Mapping[str, Any]):
        import jax
        import optax

        tx = _kernel_optimizer(optimizer).transformation
        params = {k: jax.device_put(v) for k, v in numpy_model(shapes, 0, 0.02).items()}
        self._grads = {k: jax.device_put(v) for k, v in numpy_model(shapes, 1, 1e-3).items()}
        state = _distinct_buffers(params, tx.init(params))

        def update(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self._update = jax.jit(update, donate_argnums=(0, 1))
        self._holder = [params, state]
        self._jax = jax

    def step(self) -> None:
        self._holder[0], self._holder[1] = self._update(self._holder[0], self._holder[1], self._grads)
        self._jax.block_until_ready(self._holder[0])

    def close(self) -> None:
        self._holder.clear()


class ChunkedKernel:
    """The in-process baseline over more than ``CHUNK_TENSORS`` tensors: the shard's own chunked
    update (one program over 10,000 tensors takes XLA many minutes to compile)."""

    def __init__(self, shapes: Shapes, optimizer: Mapping[str, Any]):
        from optserve.server.compute.updater import Updater

        model = numpy_model(shapes, 0, 0.02)
        self._updater = Updater(_kernel_optimizer(optimizer),
                                param_specs={k: (v.shape, v.dtype) for k, v in model.items()})
        self._updater.initialize(model)
        self._grads = numpy_model(shapes, 1, 1e-3)

    def step(self) -> None:
        self._updater.apply(self._grads, 1.0, lambda partial: partial)

    def close(self) -> None:
        self._updater = None


def kernel_role(shapes: Shapes, optimizer: Mapping[str, Any], **_):
    """The in-process baseline as a shard runs it: whole-tree, or chunked over many tensors."""
    from optserve.server.compute.chunked_update import CHUNK_TENSORS

    return (ChunkedKernel if len(shapes) > CHUNK_TENSORS else WholeTreeKernel)(shapes, optimizer)


class _ClientRole:
    """A training client of session ``session`` at ``address``: creates it, or attaches when
    ``create`` is false (the workers sweep's other workers)."""

    def __init__(self, address: str, session: str, shapes: Shapes, optimizer: Mapping[str, Any],
                 options: Mapping[str, Any], create: bool, seed: int = 0):
        from optserve.client import Client

        self.info: dict[str, Any] = {}
        self._client = Client(address, timeout=3600)
        self._open(session, shapes, optimizer, dict(options), create, seed)

    def close(self) -> None:
        try:
            self._detach()
        finally:
            self._client.close()


class NumpyRole(_ClientRole):
    """Plain dicts: ``params = session.push_pull(grads)``, fresh arrays every step."""

    VIEWS = False

    def _open(self, session, shapes, optimizer, options, create, seed):
        params = numpy_model(shapes, 0, 0.02)
        started = time.perf_counter()
        if create:
            self.session = self._client.create_session(session, params, optimizer=optimizer, **options)
        else:
            self.session = self._client.session(session)
        self.info["create_s"] = time.perf_counter() - started
        self.info["data_paths"] = sorted(set(self.session.data_paths().values()))
        del params
        self.params = self.session.pull(views=self.VIEWS)
        self.grads = self.session.gradient_buffers() if self.VIEWS else None
        self.grads = numpy_model(shapes, seed + 1, 1e-3, into=self.grads)

    def prepare(self) -> None:
        """The gradient of the next step is ready before it (computed once: outside the timing)."""

    def step(self) -> None:
        self.params = None  # as ``params = session.push_pull(grads)``: the old arrays go once the new arrive
        self.params = self.session.push_pull(self.grads)

    def _detach(self) -> None:
        self.session.detach()


class ViewsRole(NumpyRole):
    """Gradients written into ``session.gradient_buffers()``; ``push_pull(bufs, views=True)``;
    the parameters read as views of the regions (``pull(views=True)``)."""

    VIEWS = True

    def step(self) -> None:
        self.params = self.session.push_pull(self.grads, views=True)


class TorchRole(_ClientRole):
    """``RemoteOptimizer`` over a ``torch.nn.ParameterDict``; before each timed ``opt.step()``,
    ``opt.zero_grad()`` and a real ``backward`` of ``1e-3 * sum(p.sum())`` (cheap: no temporary the
    size of a parameter; it accumulates a gradient of 1e-3 everywhere into ``.grad``, in place
    where ``.grad`` exists, as any backward does), both outside the timing."""

    def _open(self, session, shapes, optimizer, options, create, seed):
        import torch

        from optserve.client.torch import RemoteOptimizer

        torch.manual_seed(seed)
        self._torch = torch
        self.model = torch.nn.ParameterDict({
            name.replace("/", "_"): torch.nn.Parameter(torch.randn(shape) * 0.02) for name, shape in shapes})
        started = time.perf_counter()
        self.opt = RemoteOptimizer(self.model.named_parameters(), self._client, optimizer, session=session, **options)
        self.info["create_s"] = time.perf_counter() - started
        self.info["data_paths"] = sorted(set(self.opt.session.data_paths().values()))
        shared = getattr(self.opt, "shared_tensors", None)
        self.info["shared_tensors"] = None if shared is None else len(shared)
        self.prepare()

    def prepare(self) -> None:
        self.opt.zero_grad()
        loss = sum(p.sum() for p in self.model.parameters()) * 1e-3
        loss.backward()

    def step(self) -> None:
        self.opt.step()

    def _detach(self) -> None:
        self.opt.close()


ROLES: dict[str, Callable[..., Any]] = {"kernel": kernel_role, "numpy": NumpyRole, "views": ViewsRole,
                                        "torch": TorchRole}


def _profile(role, steps: int, top: int) -> str:
    profile = cProfile.Profile()
    for _ in range(steps):
        if hasattr(role, "prepare"):
            role.prepare()
        profile.enable()
        role.step()
        profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(top)
    return "\n".join(line for line in text.getvalue().splitlines() if line.strip())


def serve(conn, role_name: str) -> None:
    """The process's loop: answers the bench's commands on ``conn`` until ``stop``."""
    if role_name == "torch":
        import torch  # noqa: F401 - imported before "ready": part of the process's fixed cost
    elif role_name == "kernel":
        import jax  # noqa: F401
        import optax  # noqa: F401
    import numpy  # noqa: F401

    from optserve.client import Client  # noqa: F401

    role = None
    while True:
        command, kwargs = conn.recv()
        try:
            if command == "ready":
                value: Any = {"rss": proc_status()["VmRSS"], "pid": os.getpid()}
            elif command == "setup":
                started = time.perf_counter()
                role = ROLES[role_name](**kwargs)
                value = {"setup_s": time.perf_counter() - started, **getattr(role, "info", {})}
            elif command == "step":
                if hasattr(role, "prepare"):
                    role.prepare()
                started = time.perf_counter()
                role.step()
                value = time.perf_counter() - started
            elif command == "steps":
                started = time.perf_counter()
                for _ in range(kwargs["n"]):
                    if hasattr(role, "prepare"):
                        role.prepare()
                    role.step()
                value = time.perf_counter() - started
            elif command == "memory":
                value = proc_status()
            elif command == "profile":
                value = _profile(role, kwargs.get("steps", 3), kwargs.get("top", 25))
            elif command == "stop":
                if role is not None:
                    role.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", value))
        except BaseException:  # noqa: BLE001 - the bench reports it with the point
            conn.send(("error", traceback.format_exc()))
