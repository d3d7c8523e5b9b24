"""Checkpoint trees of NumPy arrays written and read with orbax in bounded memory.

The format is orbax's own, unchanged (``PyTreeCheckpointHandler``, uncompressed, NumPy leaves
recorded as ``np.ndarray``): a ``StandardCheckpointHandler`` reads what :func:`write_tree` writes,
and :func:`restore_tree` reads checkpoints written before these functions existed. What changes is
the memory on the way:

- **Write.** orbax's default NumPy handler deep-copies every leaf before writing (the whole tree
  twice in memory); tensorstore itself then writes from the array it is given. Our handler skips
  that copy. This is safe because :func:`write_tree` is synchronous and its callers do not change
  the arrays before it returns (a shard's snapshot is given back, or its steps resume, after it).
- **Restore.** orbax reads every NumPy leaf at once, and tensorstore holds a leaf twice while it
  reads it (its decoded chunk and the result), so a restore peaked near twice the tree.
  Our handler reads the leaves in groups of at most :data:`RESTORE_GROUP_BYTES` (a larger leaf
  alone): the extra memory is one group's bytes, not the tree's.

Only NumPy leaves go through this handler; other leaf types keep orbax's handlers. Both functions
first put in place :mod:`~optserve.server.storage.tensorstore_json` (tensorstore's spec-to-JSON
conversion, which orbax calls per array, otherwise keeps every spec it converts).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

from optserve.server.storage import tensorstore_json
from optserve.server.storage.disk_health import quiet_expected_thread_errors

RESTORE_GROUP_BYTES = 128 << 20
"""At most this many bytes of leaves are read at once on restore (a larger leaf is read alone)."""


def _groups(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges over ``sizes``, in order, each summing to at most ``limit``
    unless it holds a single item."""
    ranges, start, held = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and held + size > limit:
            ranges.append((start, index))
            start, held = index, 0
        held += size
    if start < len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


@functools.lru_cache(maxsize=None)
def _registry(group_bytes: int = RESTORE_GROUP_BYTES):
    """orbax's type handler registry with NumPy leaves handled by :class:`BoundedNumpyHandler`."""
    import orbax.checkpoint as ocp

    handlers = ocp.type_handlers

    class BoundedNumpyHandler(handlers.NumpyHandler):
        """orbax's NumPy handler without its copy of every leaf on save, reading leaves in
        groups of at most ``group_bytes`` on restore."""

        def __init__(self):
            try:
                super().__init__(deepcopy_host_arrays=False)
            except TypeError:  # an orbax before the option (copying or not, as that version does)
                super().__init__()

        async def deserialize(self, infos, args=None):
            args = list(args) if args is not None else [handlers.RestoreArgs() for _ in infos]
            sizes = [int(np.prod(meta.shape, dtype=np.int64)) * np.dtype(meta.dtype).itemsize
                     for meta in await self.metadata(infos)]
            restored = []
            for start, stop in _groups(sizes, group_bytes):
                restored += await super().deserialize(infos[start:stop], args[start:stop])
            return restored

    return handlers.create_type_handler_registry(
        *[(kind, BoundedNumpyHandler() if kind is np.ndarray else handlers.get_type_handler(kind))
          for kind in handlers.supported_types()])


def write_tree(path: str, tree: Any) -> None:
    """Writes ``tree`` (nested dicts, lists or tuples of NumPy arrays) as an orbax checkpoint at
    ``path``, uncompressed, holding no copy of it. The arrays must not change until this returns.
    A full or failing disk raises here; orbax's writer threads it ends log one line each
    (:func:`~optserve.server.storage.disk_health.quiet_expected_thread_errors`)."""
    import orbax.checkpoint as ocp

    quiet_expected_thread_errors()
    tensorstore_json.install()  # orbax converts a spec per array: without it, each keeps memory
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=_registry())
    ocp.Checkpointer(handler).save(path, args=ocp.args.PyTreeSave(tree))


def restore_tree(path: str, abstract: Optional[Any] = None, group_bytes: int = RESTORE_GROUP_BYTES) -> Any:
    """The tree of the checkpoint at ``path`` with NumPy leaves, read at most ``group_bytes`` of
    leaves at a time. ``abstract``: the expected tree (``jax.ShapeDtypeStruct`` or array leaves;
    their dtypes are the ones restored); None: the tree the checkpoint's metadata describes."""
    import orbax.checkpoint as ocp

    tensorstore_json.install()
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=_registry(group_bytes)))
    if abstract is None:
        return checkpointer.restore(path)
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args))
