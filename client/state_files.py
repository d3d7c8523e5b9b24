"""A session's saved state (``Session.state()``) on disk, as an orbax checkpoint.

    optserve sessions save NAME DIR            # or: save_state(session.state(), DIR)
    client.create_session("again", state=load_state(DIR))

``DIR`` holds ``state.json`` (the format, the session's name, version, optimizer, mode,
hyperparameters, and the names of the tensors and leaves in order) and ``arrays/``, an orbax
``PyTreeCheckpointer`` checkpoint of three lists of arrays (``params``, ``tensors``, ``shared``),
in that order: tensor names may hold ``/`` or ``.``, which orbax keys may not. Readable with
orbax alone: ``PyTreeCheckpointer().restore(DIR + "/arrays")``.

orbax (``optserve[server]``) is imported when a file is written or read, never with the client.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

from optserve.client import _saved_state

_META = "state.json"
_ARRAYS = "arrays"


def _checkpointer():
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise RuntimeError("saving or loading a session's state needs orbax-checkpoint "
                           "(pip install 'optserve[server]' or orbax-checkpoint)") from None
    return ocp.PyTreeCheckpointer()


def save_state(state: Mapping[str, Any], directory: str) -> None:
    """Writes ``state`` (a ``Session.state()``) into ``directory``, which must not exist.

    Raises:
      FileExistsError; InvalidArgumentError: not a saved state.
    """
    _saved_state.checked(state, state.get("params", {}) if isinstance(state, Mapping) else ())
    directory = os.path.abspath(directory)
    if os.path.exists(directory):
        raise FileExistsError(f"{directory} exists: a saved state goes into a new directory")
    tensors = [(tensor, path) for tensor, leaves in state["tensors"].items() for path in leaves]
    meta = {key: state[key] for key in ("format", "session", "version", "optimizer", "mode", "hyperparams")}
    meta["incarnation"], meta["options"] = state.get("incarnation", ""), dict(state.get("options", {}))
    meta.update(params=list(state["params"]), tensors=[list(item) for item in tensors], shared=list(state["shared"]))
    arrays = {"params": [np.asarray(value) for value in state["params"].values()],
              "tensors": [np.asarray(state["tensors"][tensor][path]) for tensor, path in tensors],
              "shared": [np.asarray(value) for value in state["shared"].values()]}
    os.makedirs(directory)
    _checkpointer().save(os.path.join(directory, _ARRAYS), arrays)
    with open(os.path.join(directory, _META), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)


def load_state(directory: str) -> dict[str, Any]:
    """The saved state :func:`save_state` wrote into ``directory`` (``Session.state()``'s layout).

    Raises:
      FileNotFoundError; InvalidArgumentError: not a saved state.
    """
    directory = os.path.abspath(directory)
    with open(os.path.join(directory, _META)) as fh:
        meta = json.load(fh)
    arrays = _checkpointer().restore(os.path.join(directory, _ARRAYS))
    listed = {kind: [np.asarray(value) for value in arrays.get(kind) or []] for kind in ("params", "tensors", "shared")}
    if [len(listed[kind]) for kind in listed] != [len(meta.get(kind, [])) for kind in listed]:
        raise _saved_state.InvalidArgumentError(f"{directory}: {_META} and its arrays disagree on how many there are")
    tensors: dict[str, dict] = {}
    for (tensor, path), value in zip(meta["tensors"], listed["tensors"]):
        tensors.setdefault(tensor, {})[path] = value
    state = {key: meta[key] for key in ("format", "session", "version", "optimizer", "mode", "hyperparams")}
    state["incarnation"], state["options"] = meta.get("incarnation", ""), dict(meta.get("options", {}))
    state.update(params=dict(zip(meta["params"], listed["params"])), tensors=tensors,
                 shared=dict(zip(meta["shared"], listed["shared"])))
    return _saved_state.checked(state, state["params"])
