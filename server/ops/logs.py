"""The server's log output: one ``ts=... level=... logger=... event=...`` line per record on stderr.

``optserve serve --log-level`` configures the ``optserve`` logger this way in the coordinator's
process and in every shard actor's (Ray forwards the shards' stderr to the server's, each line
prefixed with the actor's name and pid). An embedded server (``start_server`` with
``ServerConfig.log_level`` None) leaves logging to its host program.
"""

from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


class _Handler(logging.StreamHandler):
    """Marks the handler this module installed (so configuring twice replaces it)."""


def configure_logging(level: str, stream=None, exclusive: bool = False) -> None:
    """Sends the ``optserve`` logger's records at ``level`` (one of :data:`LEVELS`) and above to
    ``stream`` (default: stderr) in :data:`FORMAT`. ``exclusive``: there only, not also to the
    root logger's handlers (a shard actor's process has one a library installed, which printed
    every record a second time in its own format)."""
    logger = logging.getLogger("optserve")
    logger.setLevel(level.upper())
    logger.propagate = not exclusive
    for handler in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(handler)
    handler = _Handler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%dT%H:%M:%S"))
    logger.addHandler(handler)
