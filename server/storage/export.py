"""Reading a durable session's checkpoint into your own JAX program."""

from __future__ import annotations

import json
import os

import numpy as np

from optserve.server.storage.files import session_dir
from optserve.server.storage.format import CorruptCheckpoint, format_of
from optserve.server.storage.manifests import checkpoint_versions, checksums_match, read_manifest
from optserve.server.storage.orbax_trees import restore_tree
from optserve.server.storage.snapshots import leaves


def load_checkpoint(root: str, session: str) -> dict:
    """A session's latest consistent checkpoint, for use in your own JAX program.

    Returns ``{"version": v, "params": {name: np.ndarray}, "opt_state": [state of shard 0, ...]}``
    where ``v`` is the newest version every shard of the session has a checkpoint of and each
    shard's ``opt_state`` is the optimizer's state over that shard's tensors (a pytree of NumPy
    arrays in the optimizer's own structure: rebuild it with ``optimizer.init`` on those tensors
    and ``jax.tree.unflatten``, or read it with orbax directly from
    ``DIR/sessions/<name>/shard-<i>/checkpoint-<v>``). A shard of more than 64 tensors keeps one
    state per chunk of its tensors (its manifest's ``progress.state_chunks`` says how many per
    chunk; :func:`optserve.server.compute.chunked_update.plan_chunks` says which): its
    ``opt_state`` is then the list of those states.

    Raises:
      FileNotFoundError: no such session, or a shard has no checkpoint.
      CorruptCheckpoint: a checkpoint's arrays do not match their checksums.
      UnsupportedFormat: a newer optserve wrote the session's files.
    """

    folder = session_dir(os.path.abspath(root), session)  # orbax reads absolute paths only
    entry_path = os.path.join(folder, "session.json")
    with open(entry_path, "rb") as fh:
        entry = json.loads(fh.read())
    format_of(entry_path, entry)
    shards = sorted(int(s) for s in entry["placement"])
    versions = [checkpoint_versions(os.path.join(folder, f"shard-{index}")) for index in shards]
    common = set.intersection(*versions) if versions else set()
    if not common:
        raise FileNotFoundError(f"session {session!r} has no checkpoint of one version on every shard in {folder}")
    version = max(common)
    params, states = {}, []
    for index in shards:
        manifest = read_manifest(os.path.join(folder, f"shard-{index}"), version)
        tree = restore_tree(manifest["path"])
        if not checksums_match(manifest, leaves(tree), ordered=False):  # no optimizer structure: order may differ
            raise CorruptCheckpoint(f"checkpoint {manifest['path']} does not match its checksums")
        params.update({k: np.asarray(v) for k, v in tree["params"].items()})
        states.append(tree["opt_state"])
    return {"version": version, "params": params, "opt_state": states}
