"""Torch parameter groups for :class:`~optserve.client.torch.RemoteOptimizer`.

A torch optimizer keeps its options per group in ``param_groups`` (``lr``, ``weight_decay``,
``betas``, ``eps``, ``momentum``); learning-rate schedulers edit ``group["lr"]`` between steps.
Here each group's torch options map onto the server optimizer's options (:func:`server_options`),
the groups become the session's ``param_groups`` (per-tensor options on the server), and before
each push :class:`GroupSync` sends the values a scheduler (or the user) changed, so the values in
the groups at ``step()`` are the ones that step runs with.

Momentum coefficients: a torch scheduler cycling momentum (``OneCycleLR`` / ``CyclicLR`` with
``cycle_momentum``) edits ``group["betas"]`` where the optimizer's ``defaults`` have ``betas``,
else ``group["momentum"]``. ``betas`` are among the defaults of the optimizers whose server
optimizer takes ``b1`` / ``b2`` as hyperparameters (``adam``, ``adamw``: optserve's Adam carries
each rate with its complement, so a changed rate runs as torch runs it and an unchanged one as
optax does), with the server optimizer's defaults (0.9, 0.999) where the session's arguments give
none; ``momentum`` is there when the arguments give it (``sgd``: give ``momentum=0.0`` for a
scheduler to cycle it, as ``torch.optim.SGD`` defaults to 0). Other optimizers fix their betas at
creation: their ``defaults`` have no ``betas`` (torch's scheduler then refuses ``cycle_momentum``
at once, naming it), and a changed ``betas`` is refused before anything is sent.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from optserve.client.errors import InvalidArgumentError

# Options named as in PyTorch by some server optimizers (others call the learning rate learning_rate).
_TORCH_NAMED_LR = frozenset({"adafactor_hf", "scaled_adam"})
GROUP_OPTIONS = ("lr", "weight_decay", "betas", "eps", "momentum")
_BETAS = ("b1", "b2")  # the server options a torch group's ``betas`` sets
# Server optimizers whose b1 / b2 are hyperparameters (optim_kernels.registry's decay rates), with
# their default betas (optax.adam's; the client does not import the kernels).
_CHANGEABLE_BETAS = {"adam": (0.9, 0.999), "adamw": (0.9, 0.999)}


def lr_option(optimizer: str) -> str:
    """The server option a torch group's ``lr`` sets for ``optimizer``."""
    return "lr" if optimizer in _TORCH_NAMED_LR else "learning_rate"


def server_options(optimizer: str, group: Mapping[str, Any]) -> dict[str, float]:
    """The server options of a torch group's numeric options (``betas`` -> ``b1``, ``b2``)."""
    options: dict[str, float] = {}
    for key in GROUP_OPTIONS:
        value = group.get(key)
        if key == "betas" and isinstance(value, (tuple, list)) and len(value) == 2:
            options["b1"], options["b2"] = float(value[0]), float(value[1])
        elif _is_number(value):
            options[lr_option(optimizer) if key == "lr" else key] = float(value)
    return options


def torch_defaults(optimizer: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """A torch optimizer's ``defaults`` for the server optimizer's ``args``: the options given as
    numbers, under their torch names (so ``group["lr"]`` exists for schedulers), and ``betas``
    (a tuple) where the server lets them change (see the module docstring): the arguments' ``b1``
    / ``b2``, else the server optimizer's defaults. Elsewhere ``betas`` are left out: the server
    fixes them at creation, and a scheduler cycling them (OneCycleLR's ``cycle_momentum``) then
    says at once that it needs ``cycle_momentum=False``."""
    defaults: dict[str, Any] = {}
    lr = args.get(lr_option(optimizer))
    if _is_number(lr):
        defaults["lr"] = float(lr)
    for key in ("weight_decay", "eps", "momentum"):
        if _is_number(args.get(key)):
            defaults[key] = float(args[key])
    betas = _CHANGEABLE_BETAS.get(optimizer)
    if betas is not None:
        given = [args.get(option, default) for option, default in zip(_BETAS, betas)]
        if all(_is_number(b) for b in given):
            defaults["betas"] = tuple(float(b) for b in given)
    return defaults


def split_groups(params: Iterable) -> tuple[list[tuple[str, Any]], Optional[list[dict]]]:
    """``(named parameters, groups)`` from what a user passes: ``(name, tensor)`` pairs (groups
    None), or torch-style groups ``[{"params": [(name, tensor), ...], option: value}, ...]``.

    Raises:
      InvalidArgumentError: a group without named ``params``.
    """
    items = list(params)
    if not items or not isinstance(items[0], Mapping):
        return items, None
    named, groups = [], []
    for index, group in enumerate(items):
        if not isinstance(group, Mapping) or "params" not in group:
            raise InvalidArgumentError(f"parameter group {index} must be a dict with 'params': [(name, tensor), ...]")
        members = list(group["params"])
        if not members or not all(isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], str) for m in members):
            raise InvalidArgumentError(
                f"parameter group {index}: 'params' must be (name, tensor) pairs, e.g. a selection of "
                f"model.named_parameters(), so that every tensor has its session name")
        unknown = sorted(set(group) - {"params", *GROUP_OPTIONS})
        if unknown:
            raise InvalidArgumentError(f"parameter group {index}: unknown option {unknown[0]!r}; a group may set "
                                       f"{list(GROUP_OPTIONS)}")
        named.extend(members)
        groups.append({**group, "params": members})
    return named, groups


def session_groups(optimizer: str, groups: Sequence[Mapping[str, Any]], trained: Callable[[Any], bool]) -> list[dict]:
    """The session's ``param_groups`` for torch groups: each group's tensors (those ``trained``)
    and its options under the server's names; a group with no trained tensor (a frozen part of
    the model) has no part on the server."""
    listed = ({"tensors": [name for name, tensor in group["params"] if trained(tensor)],
               **server_options(optimizer, group)} for group in groups)
    return [group for group in listed if group["tensors"]]


def group_labels(groups: Sequence[Mapping[str, Any]]) -> list[Optional[str]]:
    """Each torch group's label on the server: the index among the groups with parameters (None:
    a group without any, which nothing is sent for)."""
    labels, index = [], 0
    for group in groups:
        labels.append(str(index) if group["params"] else None)
        index += bool(group["params"])
    return labels


class GroupSync:
    """Sends the torch groups' option values that changed since they were last sent.

    Args:
      optimizer: the server optimizer's name.
      labels: each torch group's label on the server (``"default"`` without groups, else its index).
      sent: each group's server options as the session was created with them.
    """

    def __init__(self, optimizer: str, labels: Sequence[Optional[str]], sent: Sequence[Mapping[str, float]]):
        self._optimizer = optimizer
        self._labels = list(labels)
        self._sent = [dict(values) for values in sent]

    def send_changes(self, groups: Sequence[Mapping[str, Any]], set_hyperparams: Callable[..., int]) -> None:
        """Calls ``set_hyperparams(group, **changed)`` for each group whose values changed.

        Raises:
          InvalidArgumentError: a group's ``betas`` changed where the server fixes them at
            creation (optimizers other than adam / adamw); nothing is sent for any group.
        """
        changes = []
        fixed_on_server = frozenset() if self._optimizer in _CHANGEABLE_BETAS else frozenset(_BETAS)
        for index, (label, group) in enumerate(zip(self._labels, groups)):
            now = server_options(self._optimizer, group)
            changed = {option: value for option, value in now.items() if self._sent[index].get(option) != value}
            fixed = sorted(set(changed) & fixed_on_server)
            if fixed:
                raise InvalidArgumentError(
                    f"parameter group {index}: 'betas' changed to {group.get('betas')!r}, but the server fixes "
                    f"{fixed} when the session is created (a scheduler cycling them, such as OneCycleLR, needs "
                    f"cycle_momentum=False)")
            if changed and label is not None:
                changes.append((index, label, changed))
        for index, label, changed in changes:
            set_hyperparams(label, **changed)
            self._sent[index].update(changed)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
