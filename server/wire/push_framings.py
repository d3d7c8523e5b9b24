"""A PushPull step's gradients as the chunks its push reads, one class per framing.

Each framing hands the domain's push a chunk iterator that reads the step's messages as the push
consumes them, and checks what arrives with them (reply options, the shared-memory region) inside
the push: a bad option or region refuses the push like a bad chunk (nothing applied, the session's
other shards drop their parts) instead of failing after it was applied.
"""

from __future__ import annotations

from typing import Optional

from optserve.protos import contract
from optserve.protos.optserve.v1 import data_pb2
from optserve.server.domain.config import DType
from optserve.server.domain.errors import Cancelled, InvalidArgument
from optserve.server.domain.shard import ShardSession
from optserve.server.domain.waits import Wait
from optserve.server.wire.data_requests import pull_options
from optserve.server.wire.shared_memory import RegionTable


class OneMessagePush:
    """A one-message step's chunks, after its reply options (``pull``) are checked."""

    def __init__(self, step: data_pb2.PushPullStep):
        self._step = step
        self.reply: tuple[Optional[DType], int] = (None, contract.DEFAULT_CHUNK_BYTES)
        self.sparse_update = step.pull.sparse_update

    def chunks(self):
        self.reply = pull_options(self._step.pull)
        yield from self._step.chunks


class StreamedPush:
    """The chunks of a streamed push, up to its ``seal``; remembers the reply options (``pull``)
    sent with them, checked as they arrive. Messages that end before the ``seal`` raise
    ``Cancelled``: the client went away mid-step (its call may not read as cancelled yet)."""

    def __init__(self, request_iterator):
        self._requests = request_iterator
        self.reply = pull_options(data_pb2.PullRequest())
        self.sparse_update = False  # see PullRequest.sparse_update
        self.sealed = False

    def chunks(self):
        """The push's chunks; a :class:`~optserve.server.domain.waits.Wait` from the request
        stream (its next message on its way) is passed on among them."""
        for request in self._requests:
            if isinstance(request, Wait):
                yield request
                continue
            kind = request.WhichOneof("item")
            if kind == "chunk":
                yield request.chunk
            elif kind == "pull":
                self.reply = pull_options(request.pull)
                self.sparse_update = request.pull.sparse_update
            elif kind == "seal":
                self.sealed = True
                return
            else:
                raise InvalidArgument(f"PushPull: unexpected `{kind}` before `seal`")
        raise Cancelled("PushPull: the call's messages ended before the push's `seal` (the client went away)")


class RegionRead:
    """A shared-memory step's gradients as the push's chunks: the region is looked up (session,
    client, nonce) inside the push, so a refused lookup is a refused push that the session's
    other shards hear of at once."""

    def __init__(self, regions: RegionTable, session: ShardSession, client_id: str, step: data_pb2.SharedMemoryStep):
        self._lookup = lambda: regions.use(session, client_id, step)
        self.region = None
        self._done = False

    def chunks(self):
        self.region = self._lookup()
        self.region.begin_device_read()  # until done(): the device may copy the gradients up meanwhile
        yield from self.region.gradient_chunks()

    def done(self) -> None:
        """The push ended (applied, or refused): the device reads nothing more of it from the
        region (the answer may still write the reply into :attr:`region`)."""
        if self.region is not None and not self._done:
            self._done = True
            self.region.end_device_read()
