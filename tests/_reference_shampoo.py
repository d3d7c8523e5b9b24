"""Test-only import of the reference ``precondition.distributed_shampoo`` on current jax.

The reference (precondition-opt 0.3.0) was written for older jax and flax. Before importing it
this module restores, only if missing:

* ``jax.tree_map`` / ``jax.tree_flatten`` / ``jax.tree_unflatten`` / ``jax.tree_multimap`` from
  ``jax.tree_util``;
* ``jax.experimental.pjit.with_sharding_constraint`` from ``jax.lax``;
* ``flax.struct`` (``dataclass``, ``field``), which is all the reference uses of flax, as a tiny
  stand-in built on ``jax.tree_util.register_dataclass`` when flax is not installed.

Nothing here is imported by optserve itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types

import jax
import jax.experimental.pjit as _pjit
import jax.tree_util as _tu


def _install_jax_aliases() -> None:
    for name, value in {
        "tree_map": _tu.tree_map,
        "tree_multimap": _tu.tree_map,
        "tree_flatten": _tu.tree_flatten,
        "tree_unflatten": _tu.tree_unflatten,
        "tree_leaves": _tu.tree_leaves,
    }.items():
        if not hasattr(jax, name):
            setattr(jax, name, value)
    if not hasattr(_pjit, "with_sharding_constraint"):
        _pjit.with_sharding_constraint = jax.lax.with_sharding_constraint


def _struct_field(pytree_node: bool = True, **kwargs):
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata["pytree_node"] = pytree_node
    return dataclasses.field(metadata=metadata, **kwargs)


def _struct_dataclass(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if f.metadata.get("pytree_node", True)]
    meta = [f.name for f in fields if not f.metadata.get("pytree_node", True)]
    _tu.register_dataclass(cls, data_fields=data, meta_fields=meta)
    cls.replace = lambda self, **updates: dataclasses.replace(self, **updates)
    return cls


def _install_flax_struct() -> None:
    try:
        importlib.import_module("flax.struct")
        return
    except ImportError:
        pass
    flax = sys.modules.get("flax") or types.ModuleType("flax")
    struct = types.ModuleType("flax.struct")
    struct.dataclass = _struct_dataclass
    struct.field = _struct_field
    flax.struct = struct
    sys.modules["flax"] = flax
    sys.modules["flax.struct"] = struct


def load():
    """Returns the reference module ``precondition.distributed_shampoo``."""
    _install_jax_aliases()
    _install_flax_struct()
    return importlib.import_module("precondition.distributed_shampoo")

