"""A session's part on an accelerator shard, as the same-host data plane sees it.

:class:`DevicePlane` is what the wire asks of a session (through ``ShardSession.device_plane``)
to move a shared-memory client's bytes at the link's speed: the device's host link that its
regions are mapped with, the upload of a push's gradients read in place (checked finite on the
device), and the parameters read on the device under the session's lock. On a CPU shard there is
no link and no upload: the CPU reads and writes the regions where they lie.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional, TypeVar

from optserve.server.compute.device_upload import upload_checked
from optserve.server.compute.host_link import host_link
from optserve.server.compute.updater import Updater
from optserve.server.domain.config import SessionConfig
from optserve.server.domain.shard.step_runner import StepRunner

T = TypeVar("T")


class DevicePlane:
    """The device side of one session's part on a shard.

    Args:
      config: the session's configuration.
      updater: its parameters and optimizer state on this shard.
      steps: its step runner (the lock and the version).
      ready: called before a read (marks the session used; waits for its initial values or
        refuses, as the session's other reads do).
    """

    def __init__(self, config: SessionConfig, updater: Updater, steps: StepRunner, ready: Callable[[], None]):
        self._config = config
        self._updater = updater
        self._steps = steps
        self._ready = ready

    @property
    def host_link(self):
        """The device's direct path to host memory
        (:class:`~optserve.server.compute.host_link.HostLink`), or None (a CPU device)."""
        return host_link(self._updater.device)

    @property
    def upload(self) -> Optional[Callable]:
        """An accelerator's upload of a push's gradients read in place, checked there, where the
        step uses a push's gradients as they are (async, or sync steps of one push); None on a
        CPU (it reads them where they lie) and where a sync step sums several pushes on the host."""
        device, config = self._updater.device, self._config
        one_push_steps = not self._steps.queue.sync or (config.num_workers == 1 and not config.is_elastic)
        return functools.partial(upload_checked, device) if device.platform != "cpu" and one_push_steps else None

    def read_params(self, read: Callable[[Mapping[str, Any]], T]) -> tuple[int, T]:
        """The current version and ``read(parameters)``, ``read`` given the updater's own arrays
        (on the device) and called with the session's lock held, so that no step replaces (and
        donates) them while it reads."""
        self._ready()
        with self._steps.cond:
            return self._steps.version, read(self._updater.params)
