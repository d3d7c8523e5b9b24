"""What a :class:`~optserve.client.Session` reads and changes of the session as a whole, beyond
its steps: the history of its versions, its hyperparameters, and its saved state (one version of
every shard, :mod:`~optserve.client._saved_state`). A mixin of ``Session``: it uses the session's
name, client and shard fan-out.
"""

from __future__ import annotations

from typing import Union

from optserve.client import _saved_state
from optserve.client.status import HyperparamChange, RoundRecord, history_records
from optserve.protos.optserve.v1 import data_pb2


class WholeSession:
    """``history``, ``set_hyperparams`` and ``state`` of a session (the first two on its home shard)."""

    def history(self, since: int = 0) -> list[Union[RoundRecord, HyperparamChange]]:
        """What happened after version ``since``, oldest first, from the session's home shard:
        the :class:`RoundRecord` of each version (every mode: sync, one per round; async, one per
        applied push), the pushes its update applied with their client ids, sequence numbers,
        staleness, base versions and scales as applied (and for sync rounds how long they took,
        why they committed and late gradients dropped), so a run replays exactly from them; and
        every :class:`HyperparamChange` (from :meth:`set_hyperparams`), ordered by version. The
        home shard keeps the latest 4096 versions (ask with ``since`` as a long run goes); durable
        sessions keep them across restarts."""
        request = data_pb2.HistoryRequest(session=self.name, since=int(since))
        return history_records(self._fanout.served(lambda: self._home().History(request, timeout=self._client.timeout)))

    def state(self) -> dict:
        """The session's whole state at one version of every shard, as a pytree of NumPy arrays:
        its parameters, the optimizer state kept for each tensor (moments, factored statistics,
        Shampoo's statistics and roots, ...) and the state its tensors share (a step count), the
        hyperparameters in force, and the version (layout: :mod:`optserve.client._saved_state`).
        ``Client.create_session(..., state=...)`` starts a session from it, on this server or
        another, with any number of shards. Take it between steps: a session whose shards keep
        answering at different versions raises :class:`~optserve.client.errors.AbortedError`.

        Raises:
          AbortedError; FailedPreconditionError: the optimizer's state cannot be named by tensor.
        """
        return _saved_state.read_state(self)

    def set_hyperparams(self, group: Union[None, int, str] = None, **values: float) -> int:
        """Changes hyperparameters from the session's next step on (``set_hyperparams(learning_rate=3e-4)``);
        returns the version of the first step that runs with them.

        Any option of the optimizer that is a plain number and may change between steps (learning
        rates, weight decay, epsilons; not one given as a schedule) can be set, and the compiled
        update is reused. ``group``: a parameter group's index (or "default"); None: every group.
        The home shard orders the change among the pushes (every shard applies it at the same
        step); asking for values in force already changes nothing, so several workers may all
        call it. Durable sessions journal it; :meth:`history` lists it.

        Raises:
          InvalidArgumentError: an unknown group, an option that cannot be set, or a value that
            breaks the option's rule (named in the message; nothing changes).
        """
        request = data_pb2.SetHyperparamsRequest(session=self.name, values={k: float(v) for k, v in values.items()},
                                                 group="" if group is None else str(group))
        return self._fanout.served(lambda: self._home().SetHyperparams(request, timeout=self._client.timeout)).version

    def _home(self):  # the home shard's stub (asked anew each call: a restart may move it)
        return self._client.shard_data(self._shards[0].address)
