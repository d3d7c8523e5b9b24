"""A checkpoint's log rotation on a full disk, for real (a size-limited tmpfs filled to the last
byte): the fresh segment cannot get its header, so it is removed and the log goes on in the segment
it was writing; once there is room, rotation works. Before, the failed rotation left the log writing
a headerless file and the step that made the checkpoint due answered INTERNAL."""

from __future__ import annotations

import os

import pytest

from bench import filesystems
from optserve.server.storage.segments import Segments, TICKETS



@pytest.fixture
def tiny_disk(tmp_path):
    with filesystems.size_limited_tmpfs(str(tmp_path / "disk"), "1m") as mount:
        if mount is None:
            pytest.skip(f"this machine cannot mount a size-limited tmpfs: {filesystems.last_mount_error}")
        yield mount


def test_a_rotation_without_room_keeps_the_current_segment_and_a_later_one_succeeds(tiny_disk):
    segments = Segments(tiny_disk, TICKETS, 0)
    segments.write([b'{"ticket": 1}\n'])
    filler = filesystems.fill(tiny_disk)
    with pytest.raises(OSError):
        segments.rotate()
    assert segments.index == 0 and not os.path.exists(segments.path(1))  # nothing half made is left
    os.remove(filler)
    segments.write([b'{"ticket": 2}\n'])  # the log goes on where it was
    with open(segments.path(0)) as f:
        assert f.read().splitlines()[1:] == ['{"ticket": 1}', '{"ticket": 2}']
    index, old_fd = segments.rotate()
    os.close(old_fd)
    segments.write([b'{"ticket": 3}\n'])
    assert index == 1
    with open(segments.path(1)) as f:
        assert f.read().splitlines()[1:] == ['{"ticket": 3}']
    segments.close()
