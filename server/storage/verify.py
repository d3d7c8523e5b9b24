"""Offline verification of a checkpoint directory: every checkpoint and log record read and
checked, without a server (``optserve checkpoint verify DIR``).

Each file gets a :class:`FileVerdict`: ``intact``; ``torn`` (a step-log segment or journal whose
last record a crash cut short: a restore cuts it off, it was never acknowledged unless the
machine died before the write was synced); or ``corrupt`` (damage a restore cannot pass: the
session's shards come back at an earlier common version, or the session is lost). The report's
:attr:`VerifyReport.exit_status` is 0 when all is intact, 1 with torn tails only, 3 with anything
corrupt (2 is left to usage errors).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import numpy as np

from optserve.server.storage.format import CorruptCheckpoint, format_of
from optserve.server.storage.log_reader import StepLogReader, read_journal
from optserve.server.storage.manifests import checkpoint_versions, checksums_match, read_manifest
from optserve.server.storage.orbax_trees import restore_tree
from optserve.server.storage.segments import STEPS, TICKETS, segment_indices
from optserve.server.storage.snapshots import leaves

INTACT, TORN, CORRUPT = "intact", "torn", "corrupt"


@dataclasses.dataclass(frozen=True)
class FileVerdict:
    """One file (or checkpoint folder): its ``state`` (intact / torn / corrupt) and what was found."""

    path: str
    state: str
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """Every file's verdict, sessions in name order."""

    files: tuple[FileVerdict, ...]

    @property
    def exit_status(self) -> int:
        states = {f.state for f in self.files}
        return 3 if CORRUPT in states else 1 if TORN in states else 0

    def counts(self) -> dict[str, int]:
        return {state: sum(f.state == state for f in self.files) for state in (INTACT, TORN, CORRUPT)}


def verify_directory(root: str) -> VerifyReport:
    """Checks every session under ``root`` (a server's ``--checkpoint-dir``).

    Raises:
      FileNotFoundError: ``root`` holds no ``sessions`` folder.
    """
    root = os.path.abspath(root)  # orbax reads absolute paths only
    base = os.path.join(root, "sessions")
    if not os.path.isdir(base):
        raise FileNotFoundError(f"{root} is not an optserve checkpoint directory (no sessions/ folder in it)")
    found: list[FileVerdict] = []
    for folder in sorted(os.listdir(base)):
        found.extend(_verify_session(os.path.join(base, folder)))
    return VerifyReport(tuple(found))


def _verify_session(folder: str) -> Iterator[FileVerdict]:
    entry_path = os.path.join(folder, "session.json")
    try:
        with open(entry_path, "rb") as fh:
            entry = json.loads(fh.read())
        format_of(entry_path, entry)
        shapes = {name: tuple(shape) for name, _, shape in entry["config"]["tensors"]}
        placement = {int(i): list(names) for i, names in entry["placement"].items()}
    except FileNotFoundError:
        yield FileVerdict(folder, CORRUPT, "no session.json: a session folder without its definition")
        return
    except (OSError, ValueError, KeyError, TypeError, CorruptCheckpoint) as exc:
        yield FileVerdict(entry_path, CORRUPT, f"unreadable: {exc}")
        return
    yield FileVerdict(entry_path, INTACT, f"{len(shapes)} tensors on {len(placement)} shards")
    for index, names in sorted(placement.items()):
        yield from _verify_shard(os.path.join(folder, f"shard-{index}"), {n: shapes[n] for n in names})


def _verify_shard(folder: str, shapes: dict) -> Iterator[FileVerdict]:
    if not os.path.isdir(folder):
        yield FileVerdict(folder, CORRUPT, "missing")
        return
    versions = checkpoint_versions(folder)
    if not versions:
        yield FileVerdict(folder, CORRUPT, "no checkpoint manifest")
    for version in sorted(versions):
        yield _verify_checkpoint(folder, version)

    def arrays() -> dict:
        return {name: np.empty(shape, np.float32) for name, shape in shapes.items()}

    for index in segment_indices(folder, STEPS, 0):
        path = os.path.join(folder, f"{STEPS}-{index}.log")
        reader = StepLogReader(path, arrays)
        try:
            versions_read = [int(header["version"]) for header, _ in reader]
        except (CorruptCheckpoint, ValueError, KeyError) as exc:
            yield FileVerdict(path, CORRUPT, str(exc))
            continue
        span = f"steps {versions_read[0]}-{versions_read[-1]}" if versions_read else "no steps"
        if reader.torn_at is not None:
            yield FileVerdict(path, TORN, f"{span}; a torn record at byte {reader.torn_at}")
        else:
            yield FileVerdict(path, INTACT, span)
    for index in segment_indices(folder, TICKETS, 0):
        path = os.path.join(folder, f"{TICKETS}-{index}.log")
        try:
            entries = read_journal(path)
        except (CorruptCheckpoint, ValueError) as exc:
            yield FileVerdict(path, CORRUPT, f"unreadable: {exc}")
            continue
        with open(path, "rb") as fh:
            torn = not fh.read().endswith(b"\n") and os.path.getsize(path) > 0
        yield FileVerdict(path, TORN if torn else INTACT, f"{len(entries)} entries" + ("; a torn last line" * torn))


def _verify_checkpoint(folder: str, version: int) -> FileVerdict:

    try:
        manifest = read_manifest(folder, version)
        tree = restore_tree(manifest["path"])
        if not checksums_match(manifest, leaves(tree), ordered=False):
            return FileVerdict(manifest["path"], CORRUPT, "its arrays do not match the manifest's checksums")
    except CorruptCheckpoint as exc:
        return FileVerdict(os.path.join(folder, f"checkpoint-{version}"), CORRUPT, str(exc))
    except Exception as exc:  # noqa: BLE001 - orbax raises many kinds on damaged files
        return FileVerdict(os.path.join(folder, f"checkpoint-{version}"), CORRUPT,
                           f"cannot be read: {type(exc).__name__}: {exc}")
    return FileVerdict(manifest["path"], INTACT, f"version {version}")
