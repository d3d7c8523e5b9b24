"""The demo's optimizers: each one's server-side spec and its in-process twin (the baseline run)."""

from __future__ import annotations

from typing import Any

import numpy as np

DEMO_OPTIMIZERS = ("adam", "adafactor_hf", "muon", "soap")


def optimizer_spec(name: str, lr: float) -> dict[str, Any]:
    """The server-side optimizer for ``name`` (see :func:`in_process_optimizer` for its twin)."""
    if name == "adam":
        return {"name": "adam", "args": {"learning_rate": lr}}
    if name == "adafactor_hf":
        return {"name": "adafactor_hf", "args": {"lr": lr, "relative_step": False, "scale_parameter": False}}
    if name == "muon":
        return {"name": "muon", "args": {"learning_rate": lr}}
    if name == "soap":
        return {"name": "soap", "args": {"learning_rate": lr, "precondition_frequency": 10}}
    raise ValueError(f"demo optimizer must be one of {', '.join(DEMO_OPTIMIZERS)}, got {name!r}")


def in_process_optimizer(name: str, lr: float, params):
    """The same optimizer as :func:`optimizer_spec`, as a torch optimizer in this process."""
    import torch

    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    if name == "adafactor_hf":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, relative_step=False, scale_parameter=False)
    if name in ("muon", "soap"):  # no torch twin with the same semantics: the server's own kernel, here
        return KernelInProcess(params, optimizer_spec(name, lr))
    raise ValueError(f"demo optimizer must be one of {', '.join(DEMO_OPTIMIZERS)}, got {name!r}")


class KernelInProcess:
    """A registry kernel (``optserve.optim_kernels``) stepping torch parameters in this process:
    the in-process twin of optimizers without a torch implementation of the same semantics."""

    def __init__(self, params, spec: dict[str, Any]):
        import jax
        import optax

        from optserve.optim_kernels import build_optimizer  # pulls jax: only for muon / soap

        self._params = list(params)
        self.name = spec["name"]
        tx = build_optimizer(spec["name"], spec["args"]).transformation
        self._values = {f"p{i}": jax.numpy.asarray(p.detach().numpy()) for i, p in enumerate(self._params)}
        self._state = tx.init(self._values)

        def step(values, state, grads):
            updates, state = tx.update(grads, state, values)
            return optax.apply_updates(values, updates), state

        self._step = jax.jit(step)

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def step(self) -> None:
        import torch

        grads = {f"p{i}": p.grad.detach().numpy() for i, p in enumerate(self._params)}
        self._values, self._state = self._step(self._values, self._state, grads)
        with torch.no_grad():
            for i, p in enumerate(self._params):
                p.copy_(torch.from_numpy(np.array(self._values[f"p{i}"])))
