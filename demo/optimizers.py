"""The demo's optimizers: each one's server-side spec and its in-process twin (the baseline run),
and the learning rate they step with: by default a warmup + cosine schedule given by spec, which
the server evaluates at the session's own step count (``optserve.optim_kernels.schedules``)."""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

DEMO_OPTIMIZERS = ("adam", "adafactor_hf", "muon", "soap")
LR_SCHEDULES = ("warmup_cosine", "constant")  # ``--schedule``
WARMUP_FRACTION = 0.05  # of the session's updates, warming up from 0
END_FRACTION = 0.1  # the cosine ends at this fraction of the peak rate

LearningRate = Union[float, dict[str, Any]]  # a number, or a schedule spec ({"schedule": NAME, ...})


def learning_rate(schedule: str, peak: float, total_steps: int) -> LearningRate:
    """The learning rate of a session that makes ``total_steps`` updates: ``peak`` for
    ``"constant"``; for ``"warmup_cosine"`` the spec of optax's ``warmup_cosine_decay_schedule``:
    linear from 0 to ``peak`` over the first 5% of the updates (at least one), then a cosine down
    to ``peak / 10`` at ``total_steps`` (``decay_steps`` counts the warmup too)."""
    if schedule == "constant":
        return peak
    if schedule == "warmup_cosine":
        return {"schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": peak,
                "warmup_steps": max(1, round(WARMUP_FRACTION * total_steps)), "decay_steps": total_steps,
                "end_value": peak * END_FRACTION}
    raise ValueError(f"--schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")


def describe_learning_rate(rate: LearningRate) -> str:
    """One line saying what ``rate`` (see :func:`learning_rate`) does, for the demo's output."""
    if not isinstance(rate, dict):
        return f"lr={rate:g} (constant)"
    return (f"lr {rate['schedule']}: {rate['init_value']:g} -> {rate['peak_value']:g} over {rate['warmup_steps']} "
            f"warmup steps, cosine to {rate['end_value']:g} at step {rate['decay_steps']} (evaluated by the server)")


def optimizer_spec(name: str, lr: LearningRate) -> dict[str, Any]:
    """The server-side optimizer for ``name`` with learning rate ``lr`` (a number or a schedule
    spec; see :func:`in_process_optimizer` for its twin)."""
    if name == "adam":
        return {"name": "adam", "args": {"learning_rate": lr}}
    if name == "adafactor_hf":
        return {"name": "adafactor_hf", "args": {"lr": lr, "relative_step": False, "scale_parameter": False}}
    if name == "muon":
        return {"name": "muon", "args": {"learning_rate": lr}}
    if name == "soap":
        return {"name": "soap", "args": {"learning_rate": lr, "precondition_frequency": 10}}
    raise ValueError(f"demo optimizer must be one of {', '.join(DEMO_OPTIMIZERS)}, got {name!r}")


def in_process_optimizer(name: str, lr: LearningRate, params, total_steps: int):
    """The same optimizer as :func:`optimizer_spec`, as a torch optimizer in this process, and the
    torch twin of its schedule: ``(optimizer, scheduler)``, ``scheduler`` a
    ``torch.optim.lr_scheduler.LambdaLR`` to step after every ``optimizer.step()`` (its factors
    are the server's own optax schedule, evaluated here at steps 0 .. ``total_steps``), or None
    (a constant rate; muon and soap run the server's kernel, which evaluates the schedule itself)."""
    import torch

    peak = lr["peak_value"] if isinstance(lr, dict) else lr
    if name == "adam":
        optimizer = torch.optim.Adam(params, lr=peak, betas=(0.9, 0.999), eps=1e-8)
    elif name == "adafactor_hf":
        from transformers.optimization import Adafactor

        optimizer = Adafactor(params, lr=peak, relative_step=False, scale_parameter=False)
    elif name in ("muon", "soap"):  # no torch twin with the same semantics: the server's own kernel, here
        return KernelInProcess(params, optimizer_spec(name, lr)), None
    else:
        raise ValueError(f"demo optimizer must be one of {', '.join(DEMO_OPTIMIZERS)}, got {name!r}")
    return optimizer, _torch_schedule(optimizer, lr, total_steps)


def _torch_schedule(optimizer, lr: LearningRate, total_steps: int) -> Optional[Any]:
    """A LambdaLR whose factor at step t is the schedule spec ``lr`` at t over its peak (None for a number)."""
    if not isinstance(lr, dict):
        return None
    import torch

    from optserve.optim_kernels.schedules import build_schedule  # the server's own spec -> optax schedule

    schedule = build_schedule(lr, "demo learning rate")
    factors = [float(v) / lr["peak_value"] for v in np.asarray(schedule(np.arange(total_steps + 1)))]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factors[min(step, total_steps)])


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
