"""A session's saved state in torch's ``Optimizer.state_dict()`` layout, and back.

:meth:`~optserve.client.torch.RemoteOptimizer.state_dict` returns what a torch optimizer would,
with the server optimizer's state in it, so that a trainer that saves ``optimizer.state_dict()``
(Hugging Face's ``optimizer.pt``, Lightning's ``optimizer_states``) saves everything needed to
resume, on any server::

    {"state": {i: {path: tensor}},         # parameter i's optimizer state: "0.mu", "0.nu", ...,
                                           # and the shared leaves ("0.count") repeated, as torch
                                           # keeps a "step" per parameter
     "param_groups": [{"lr": ..., ..., "params": [i, ...]}],
     "optserve": {"format": FORMAT, "session": name, "version": v, "incarnation": ..., "tensor_names": [...],
                  "optimizer": {...}, "mode": ..., "hyperparams": {group: {option: value}},
                  "params": {tensor: tensor}, "shared": {path: tensor}}}

Tensors share memory with the arrays the server's answer was read into (no second copy).
Imports torch and NumPy only.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from optserve.client import _saved_state

FORMAT = "optserve.RemoteOptimizer/2"
_FORMER = "optserve.RemoteOptimizer/1"


def to_torch(saved: Mapping[str, Any], tensor_names: Sequence[str], param_groups: Sequence[Mapping]) -> dict:
    """``saved`` (a :meth:`Session.state`) as a torch optimizer's ``state_dict`` of parameters
    ``tensor_names`` in groups ``param_groups`` (torch's, each with its ``params``)."""
    index = {name: i for i, name in enumerate(tensor_names)}
    shared = {path: _tensor(value) for path, value in saved["shared"].items()}
    state = {}
    for name in tensor_names:
        leaves = {path: _tensor(value) for path, value in saved["tensors"].get(name, {}).items()}
        state[index[name]] = {**leaves, **shared}
    position = {}
    groups = []
    for group in param_groups:
        numbered = []
        for p in group["params"]:
            position.setdefault(id(p), len(position))
            numbered.append(position[id(p)])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbered})
    return {"state": state, "param_groups": groups,
            "optserve": {"format": FORMAT, "session": saved["session"], "version": int(saved["version"]),
                         "incarnation": saved.get("incarnation", ""),
                         "tensor_names": list(tensor_names), "optimizer": saved["optimizer"], "mode": saved["mode"],
                         "hyperparams": saved["hyperparams"],
                         "params": {name: _tensor(value) for name, value in saved["params"].items()},
                         "shared": shared}}


def from_torch(state_dict: Mapping[str, Any], tensor_names: Sequence[str]) -> dict:
    """The saved state (:mod:`~optserve.client._saved_state`) a :func:`to_torch` dictionary holds.

    Raises:
      ValueError: not such a dictionary (an older optserve's, which held no optimizer state, is
        named as such), or one of other tensors.
    """
    meta = state_dict.get("optserve") if isinstance(state_dict, Mapping) else None
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
        if isinstance(state_dict, Mapping) and state_dict.get("format") == _FORMER:
            raise ValueError("this state_dict was saved by an older optserve: it names a session and a version but "
                             "holds no optimizer state, so it cannot be restored exactly; save it again")
        raise ValueError(f"not a RemoteOptimizer state_dict (no 'optserve' entry of format {FORMAT!r})")
    names = list(meta["tensor_names"])
    if names != list(tensor_names):
        raise ValueError(f"state_dict's tensors {names} differ from this optimizer's {list(tensor_names)}")
    shared = {path: _array(value) for path, value in meta["shared"].items()}
    tensors = {}
    for i, name in enumerate(names):
        entry = state_dict["state"].get(i, state_dict["state"].get(str(i), {}))
        tensors[name] = {path: _array(value) for path, value in entry.items() if path not in shared}
    return _saved_state.checked({"format": _saved_state.FORMAT, "session": meta["session"],
                                 "version": int(meta["version"]), "incarnation": meta.get("incarnation", ""),
                                 "optimizer": meta["optimizer"],
                                 "mode": meta["mode"], "hyperparams": meta["hyperparams"],
                                 "params": {name: _array(value) for name, value in meta["params"].items()},
                                 "tensors": tensors, "shared": shared}, names)


def _tensor(value) -> torch.Tensor:
    """An array as a tensor sharing its memory (ml_dtypes' bfloat16 through its 16 bits)."""
    array = np.asarray(value)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _array(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype == torch.bfloat16:  # NumPy has no bfloat16 of its own: the bits, as ml_dtypes reads them
            import ml_dtypes

            return value.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return value.cpu().numpy()
    return np.asarray(value)
