"""Checkpoint manifests: the commit marker of a checkpoint, its arrays' checksums, and GC.

A checkpoint ``checkpoint-<v>/`` (orbax's folder) becomes visible only once its manifest
``checkpoint-<v>.json`` is renamed into place; older checkpoints are deleted only after that.
The manifest holds the shard's progress at ``v``, the home shard's clock state, where the log
segments after it start, the format version and one checksum per array (CRC-32C; manifests
written before it carry zlib's CRC-32 under ``"crc32"``, still verified).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

from optserve.server.storage.checksums import array_checksum
from optserve.server.storage.files import write_atomically
from optserve.server.storage.format import FORMAT_KEY, FORMAT_VERSION, CorruptCheckpoint, format_of

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)\.json$")
_CHECKSUM = "crc32c"  # the manifest's key for its arrays' checksums (older manifests: "crc32", zlib's)


def checksums_match(manifest: dict, leaves: list, ordered: bool = True) -> bool:
    """Whether ``leaves`` (arrays) match the manifest's checksums: in order, or as a multiset
    when ``ordered`` is False (a tree restored without its optimizer's structure)."""
    kind, expected = _manifest_checksums(manifest)
    sums = [array_checksum(a, kind) for a in leaves]
    return sums == list(expected) if ordered else sorted(sums) == sorted(expected)


def _manifest_checksums(manifest: dict) -> tuple[str, list]:
    """``(kind, checksums)`` of a manifest's arrays."""
    for kind in (_CHECKSUM, "crc32"):
        if kind in manifest:
            return kind, manifest[kind]
    raise CorruptCheckpoint(f"checkpoint manifest of version {manifest.get('progress', {}).get('version')} "
                            f"has no checksums")


def checkpoint_versions(folder: str) -> set[int]:
    """The versions of the committed checkpoints (those with a manifest) in a shard's folder."""
    return {int(m.group(1)) for m in map(_CHECKPOINT_RE.match, os.listdir(folder)) if m}


def read_manifest(folder: str, version: int) -> dict:
    """The manifest of the checkpoint of ``version`` in ``folder``, with its folder as ``"path"``.

    Raises:
      CorruptCheckpoint: it cannot be read; UnsupportedFormat: a newer optserve wrote it.
    """
    path = os.path.join(folder, f"checkpoint-{version}.json")
    try:
        with open(path, "rb") as fh:
            manifest = json.loads(fh.read())
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"checkpoint manifest {path} is unreadable: {exc}") from None
    format_of(path, manifest)
    manifest["path"] = os.path.join(folder, f"checkpoint-{version}")
    return manifest


def latest_manifest(folder: str) -> Optional[dict]:
    """The latest committed checkpoint's manifest (None: none), after removing what a crash left
    half-written (orbax temporary folders, checkpoints without a manifest)."""
    versions = checkpoint_versions(folder)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and (".orbax-checkpoint-tmp" in name or not (
                name.startswith("checkpoint-") and name[len("checkpoint-"):].isdigit()
                and int(name[len("checkpoint-"):]) in versions)):
            shutil.rmtree(path, ignore_errors=True)
    return read_manifest(folder, max(versions)) if versions else None


def commit_manifest(path: str, manifest: dict, leaves: list, written_unix_s: float) -> None:
    """Writes the manifest of the checkpoint folder ``path`` (whose arrays are ``leaves``): the
    checkpoint's commit."""
    manifest[_CHECKSUM] = [array_checksum(a, _CHECKSUM) for a in leaves]
    manifest[FORMAT_KEY] = FORMAT_VERSION
    manifest["written_unix_s"] = written_unix_s
    write_atomically(f"{path}.json", json.dumps(manifest).encode())


def drop_checkpoints_older_than(folder: str, version: int) -> None:
    """Deletes the checkpoints (manifest first, then folder) older than ``version``."""
    _drop_checkpoints(folder, lambda v: v < version)


def drop_checkpoints_newer_than(folder: str, version: int) -> None:
    """Deletes the checkpoints (manifest first, then folder) newer than ``version``."""
    _drop_checkpoints(folder, lambda v: v > version)


def _drop_checkpoints(folder: str, dropped) -> None:
    for name in os.listdir(folder):
        match = _CHECKPOINT_RE.match(name)
        if match and dropped(int(match.group(1))):
            os.unlink(os.path.join(folder, name))
            shutil.rmtree(os.path.join(folder, name[:-len(".json")]), ignore_errors=True)
