"""Gradients written by hand keep torch's meaning in ``RemoteOptimizer`` (issue 56).

With ``zero_copy`` (the default, on a same-host server) a bound ``.grad`` is never ``None``:
where torch would hold ``None`` it holds zeros the SDK remembers as none. A gradient written
into it (``fill_``, ``copy_``, ``add_`` in the ``else`` branch of ``if p.grad is None``), or
assigned, counts and is pushed; one torch would hold as ``None`` is left out of the push, as a
torch optimizer skips it; zeros from ``zero_grad(set_to_none=False)`` count only where torch held
a gradient. Each loop runs against ``torch.optim`` in process on the same model and the same
written gradients (SGD with momentum, where a zero gradient moves a parameter and no gradient
does not; and AdamW, whose decay moves any parameter pushed), with ``zero_copy`` True and False.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

from optserve.client.torch import RemoteOptimizer

LR, MOMENTUM = 0.1, 0.9
SGD = {"name": "sgd", "args": {"learning_rate": LR, "momentum": MOMENTUM}}
ADAMW = {"name": "adamw", "args": {"learning_rate": 1e-2, "weight_decay": 0.1}}
STEPS = 4

Recipe = Callable[[int, list, object], None]  # (step, [(name, parameter)], optimizer): writes .grad


def _linear() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Linear(64, 32)


def _square() -> torch.nn.Module:
    torch.manual_seed(12)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))


MODELS = {"linear_64x32": _linear, "two_square_64": _square}


def _value(p: torch.Tensor, step: int, index: int) -> torch.Tensor:
    """A gradient for parameter ``index`` at ``step``: the same on both sides of a comparison."""
    return torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + index))


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """The issue's pattern: the first write assigns, later ones accumulate in place."""
    if p.grad is None:
        p.grad = g.clone()
    else:
        p.grad.add_(g)


# --- the loops: each writes gradients by hand, as training code does ------------------------------


def _add_after_zero_grad(step, named, opt):
    """Two micro-batches accumulated by hand, then averaged in place (``add_``, ``mul_``)."""
    opt.zero_grad()
    for micro in range(2):
        for i, (_, p) in enumerate(named):
            _accumulate(p, _value(p, 10 * step + micro, i))
    for _, p in named:
        p.grad.mul_(0.5)


def _copy_reduced(step, named, opt):
    """A reduced gradient copied in (``copy_``), for every other parameter: the rest are None."""
    opt.zero_grad()
    for i, (_, p) in enumerate(named):
        if (i + step) % 2 == 0:
            reduced = _value(p, step, i)
            if p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.copy_(reduced)


def _fill(step, named, opt):
    """``fill_`` into the first parameter only; the others are None and stay put."""
    opt.zero_grad()
    _, p = named[0]
    if p.grad is None:
        p.grad = torch.full_like(p, 0.25 * (step + 1))
    else:
        p.grad.fill_(0.25 * (step + 1))


def _assigned(step, named, opt):
    """The first parameter's gradient assigned a fresh tensor (at step 2 zeros: a gradient of zeros,
    which momentum moves), the others accumulated in place."""
    opt.zero_grad()
    for i, (_, p) in enumerate(named):
        if i == 0:
            p.grad = torch.zeros_like(p) if step == 2 else _value(p, step, i)
        else:
            _accumulate(p, _value(p, step, i))


def _set_to_none_false(step, named, opt):
    """``zero_grad()`` first, then ``zero_grad(set_to_none=False)``; parameter i written from step
    i on: a parameter written once holds zeros that count from then on, one never written stays None."""
    opt.zero_grad(set_to_none=step == 0)
    for i, (_, p) in enumerate(named):
        if i <= step:
            _accumulate(p, _value(p, step, i))


def _none_then_zeros(step, named, opt):
    """Steps 0-1 write every gradient; step 2 clears them (None) and writes the first; step 3
    zeroes with ``set_to_none=False``: the first holds zeros that count (momentum moves it), the
    others stay None (their momentum does not move them), and the last is written."""
    if step < 2:
        opt.zero_grad()
        for i, (_, p) in enumerate(named):
            _accumulate(p, _value(p, step, i))
    elif step == 2:
        opt.zero_grad()
        _accumulate(named[0][1], _value(named[0][1], step, 0))
    else:
        opt.zero_grad(set_to_none=False)  # named[0] holds a gradient: zeros that count; others stay None
        _accumulate(named[-1][1], _value(named[-1][1], step, 1))


def _user_sets_none(step, named, opt):
    """Written with ``add_``; the user then sets the last parameter's ``.grad = None`` at odd steps."""
    opt.zero_grad()
    for i, (_, p) in enumerate(named):
        _accumulate(p, _value(p, step, i))
    if step % 2 == 1:
        named[-1][1].grad = None


RECIPES: dict[str, Recipe] = {
    "add_": _add_after_zero_grad,
    "copy_": _copy_reduced,
    "fill_": _fill,
    "assigned": _assigned,
    "set_to_none_False": _set_to_none_false,
    "none_then_zeros": _none_then_zeros,
    "user_sets_None": _user_sets_none,
}


# --- the comparison ----------------------------------------------------------------------------


def _values(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_close(remote, local, where) -> None:
    for (name, a), b in zip(remote.named_parameters(), local.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=0, atol=1e-6,
                                   err_msg=f"{where}: {name}")


def _assert_bound(model, opt) -> None:
    """zero_copy: every parameter and its .grad (after a step: any .grad assigned by hand too) live
    in the regions, so the loop ran on the path the issue is about."""
    params, grads = opt.session.parameter_buffers(), opt.session.gradient_buffers()
    assert sorted(opt.shared_tensors) == sorted(opt.tensor_names)
    for name, p in model.named_parameters():
        assert p.data_ptr() == params[name].__array_interface__["data"][0], name
        assert p.grad is not None and p.grad.data_ptr() == grads[name].__array_interface__["data"][0], name


def _compare(address: str, session: str, make_model, recipe: Recipe, spec: dict, reference,
             steps: int = STEPS) -> None:
    """``recipe``'s loop in lockstep through ``reference`` (a torch.optim constructor) in process
    and two RemoteOptimizers, ``zero_copy`` True (gradients in the regions) and False (copied):
    equal parameters after every step, and one session version per step at which torch held any
    gradient (nothing pushed otherwise)."""
    local = make_model()
    start = _values(local)
    local_opt = reference(local.parameters())
    remotes = []
    try:
        for zero_copy in (True, False):
            model = make_model()
            name = f"{session}-{'bound' if zero_copy else 'copied'}"
            remotes.append((zero_copy, model, RemoteOptimizer(model.named_parameters(), address, spec, session=name,
                                                              zero_copy=zero_copy)))
        for zero_copy, model, opt in remotes:
            if zero_copy:
                _assert_bound(model, opt)
            else:
                assert opt.shared_tensors == []
        pushes = 0
        for step in range(steps):
            recipe(step, list(local.named_parameters()), local_opt)
            pushes += any(p.grad is not None for p in local.parameters())
            local_opt.step()
            for zero_copy, model, opt in remotes:
                where = f"zero_copy={zero_copy}, step {step}"
                recipe(step, list(model.named_parameters()), opt)
                opt.step()
                _assert_close(model, local, where)
                assert opt.version == pushes, f"{where}: session version {opt.version}, torch stepped {pushes} times"
                if zero_copy:
                    _assert_bound(model, opt)
        moved = _values(local)
        assert any(not torch.equal(moved[n], start[n]) for n in start)  # the loop trained something
    finally:
        for _, _, opt in remotes:
            opt.session.close()
            opt.close()


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gradients_written_by_hand_train_as_torch_sgd_with_momentum(server, unique_name, recipe, model):
    _compare(server.address, unique_name, MODELS[model], RECIPES[recipe], SGD, _sgd)


def _first_layer_by_hand(step, named, opt):
    """AdamW: the first layer written by hand every step after ``zero_grad(set_to_none=False)``;
    the second never written, so torch holds None for it and its decay never runs."""
    opt.zero_grad(set_to_none=False)
    for i, (name, p) in enumerate(named):
        if name.startswith("0."):
            _accumulate(p, _value(p, step, i))


def _every_parameter_by_hand(step, named, opt):
    """AdamW: every gradient written by hand (``copy_`` then ``add_``) after ``zero_grad()``."""
    opt.zero_grad()
    for i, (_, p) in enumerate(named):
        g = _value(p, step, i)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        p.grad.add_(0.1 * g)


@pytest.mark.parametrize("recipe", ["first_layer", "every_parameter"])
def test_gradients_written_by_hand_train_as_torch_adamw(server, unique_name, recipe):
    loop = _first_layer_by_hand if recipe == "first_layer" else _every_parameter_by_hand
    _compare(server.address, unique_name, _square, loop, ADAMW, _adamw)


X = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))


def _backward_clip_and_write(step, named, opt):
    """Two backwards accumulate per step; they reach the second layer only at step 0, and at step 2
    its weight gets a gradient by hand. Every step ends with ``clip_grad_norm_``, whose in-place
    ``mul_`` runs on every gradient that is not None: it must not make a gradient torch holds as
    None count (it moves a version counter as a write does)."""
    opt.zero_grad()
    params = dict(named)
    for micro in range(2):
        first = torch.nn.functional.linear(X[4 * micro: 4 * micro + 4], params["0.weight"], params["0.bias"])
        if step == 0:
            out = torch.nn.functional.linear(torch.tanh(first), params["1.weight"], params["1.bias"])
        else:
            out = first
        (out ** 2).mean().backward()
    if step == 2:
        _accumulate(params["1.weight"], _value(params["1.weight"], step, 2))
    torch.nn.utils.clip_grad_norm_([p for _, p in named], max_norm=0.5)


def test_backward_with_clipping_and_a_gradient_written_by_hand_train_as_torch(server, unique_name):
    _compare(server.address, unique_name, _square, _backward_clip_and_write, SGD, _sgd)


def test_a_step_right_after_creation_pushes_nothing_until_a_gradient_is_written(server, unique_name):
    """Right after creation torch holds every gradient as None: ``step()`` (also after
    ``zero_grad(set_to_none=False)``, which leaves None alone) pushes nothing; then a gradient
    written into ``.grad`` as training code does (zero_copy: in place, into the region) is pushed,
    the session's first step; the bias, still None, stays put."""
    for zero_copy in (True, False):
        model = _linear()
        start = _values(model)
        opt = RemoteOptimizer(model.named_parameters(), server.address, SGD, session=f"{unique_name}-{zero_copy}",
                              zero_copy=zero_copy)
        try:
            opt.step()
            opt.zero_grad(set_to_none=False)
            opt.step()
            assert opt.version == 0 and opt.session.status().version == 0, zero_copy
            assert all(torch.equal(p.detach(), start[n]) for n, p in model.named_parameters()), zero_copy
            _accumulate(model.weight, torch.ones_like(model.weight))
            opt.step()
            assert opt.version == 1, zero_copy
            torch.testing.assert_close(model.weight.detach(), start["weight"] - LR, rtol=0, atol=1e-6)
            assert torch.equal(model.bias.detach(), start["bias"]), zero_copy
        finally:
            opt.session.close()
            opt.close()
