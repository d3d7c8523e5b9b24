"""The job of :class:`~optserve.client.torch.RemoteOptimizer` that decides which session it trains
in: its ``state_dict`` / ``load_state_dict`` (a checkpoint puts the session, and the model, where
it was: :mod:`~optserve.client._torch_checkpoint` is the layout), and following a session another
worker replaced. A mixin of ``RemoteOptimizer``: it reads the optimizer's session, client, model,
stepper and groups. Imports torch and the NumPy client only.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from optserve.client._torch_checkpoint import from_torch, to_torch
from optserve.client._torch_groups import GroupSync
from optserve.client.errors import NotFoundError, SessionReplacedError
from optserve.client.overlap import DelayedStepper


class SessionSwitching:
    """``state_dict``, ``load_state_dict`` and the session switches they and a replaced session make."""

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's whole state, as torch's optimizers lay it out: what a checkpoint needs.

        ``state`` holds, by parameter index, the server optimizer's state for that tensor as
        tensors (moments, factored statistics, Shampoo's and SOAP's statistics and roots, Muon's
        momentum, and the step counts the tensors share); ``param_groups`` the options in force;
        ``optserve`` the session's name and version, its parameters at that version and its
        hyperparameters (layout: :mod:`optserve.client._torch_checkpoint`). It is one version
        of every shard (``Session.state``); save it with ``torch.save`` beside the model's.
        With ``overlap=True`` the step in flight is waited for first.

        Raises:
          AbortedError: other workers' steps kept landing while the state was read.
        """
        self.synchronize()
        return to_torch(self._session.state(), self.tensor_names, self.param_groups)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Puts this optimizer's session, and the model, exactly where ``state_dict`` was.

        The session (this optimizer's: ``session=``) is replaced by one created from the
        checkpoint: its parameters, optimizer state, version and hyperparameters, whether the
        session is ahead of the checkpoint (it is rewound), behind it, closed, or on a server
        that never saw it. The checkpoint's parameters are written into the model, so the
        order a trainer loads the model and the optimizer in does not matter, and
        ``param_groups`` take the checkpoint's options (a scheduler's position is its own
        ``state_dict``). Other workers attached to the session find it replaced at their next
        step (refused, ``SessionReplacedError``; a ``RemoteOptimizer`` attaches again and warns).
        A checkpoint of the session's very state (same session, incarnation and version: a round
        trip such as accelerate's ``prepare`` makes) replaces nothing: the model takes its
        parameters and the groups their options.

        Raises:
          ValueError: not a :meth:`state_dict` of this class (an older optserve's holds no
            optimizer state and is refused, saying so), or of other tensors.
          InvalidArgumentError: the checkpoint's state does not fit this optimizer (another
            optimizer or options): the message names the leaf; the session is then gone.
        """
        saved = from_torch(state_dict, self.tensor_names)
        if self._stepper is not None:
            self._stepper.wait()
        saved_groups = state_dict.get("param_groups", ())
        for group, saved_group in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        if self._holds(saved):  # the session is where the checkpoint was (a round trip, as accelerate's prepare does)
            self._model.write(saved["params"])
        else:
            self._replace_session(saved)
        self._groups_sync = self._group_sync(saved["hyperparams"])

    def _holds(self, saved: Mapping[str, Any]) -> bool:
        """Whether this optimizer's session is, now, the very state ``saved`` holds: the same
        session, incarnation and version (a version's state is one per incarnation)."""
        incarnation = self._session.info.config.incarnation
        if saved["session"] != self.config.session or not incarnation or saved.get("incarnation") != incarnation:
            return False
        return self._session.status().version == int(saved["version"])

    def _replace_session(self, saved: Mapping[str, Any]) -> None:
        """This optimizer's session becomes one created from ``saved`` (the former one, if any,
        is closed); the model takes its parameters."""
        name = self.config.session
        self._session.detach()
        try:
            self._client.close_session(name)
        except NotFoundError:  # closed, lost with a restarted server, or never created there
            pass
        self._switch_to(self._client.create_session_with(name, saved["params"], self.config.options,
                                                         worker_id=self._worker_id, state=saved), created=True)

    def _switch_to(self, session, created: bool) -> None:
        """Trains in ``session`` from now on (the former one detached): the model follows it
        (its regions) and takes its parameters."""
        self._session, self.created = session, created
        self._model.follow(session)
        if self._stepper is not None:
            self._stepper = DelayedStepper(session)
        self._pull_into_model()
        self._model.bind_gradients()

    def _group_sync(self, hyperparams: Mapping[str, Mapping[str, float]]) -> GroupSync:
        """What the groups' options are on the server: as the session was created, with the
        hyperparameters in force (``hyperparams``, by group label) over them."""
        sent = [{**created, **hyperparams.get(label, {})} if label is not None else created
                for label, created in zip(self._group_labels, self._created_options)]
        return GroupSync(self.config.options.optimizer, self._group_labels, sent)

    def _reattach(self, replaced: SessionReplacedError) -> None:
        """The session was replaced (another worker loaded a checkpoint into it) after this
        optimizer attached: the step is dropped, and the optimizer attaches to the new session
        and loads its parameters into the model; a warning says so."""
        self._session.detach()
        self._switch_to(self._client.session(self.config.session, expect=self.config.options,
                                             worker_id=self._worker_id), created=False)
        self.stale_pushes += 1
        self._groups_sync = self._group_sync(self._session.status().hyperparams)
        warnings.warn(f"optserve: {replaced.details}. This step was dropped; the optimizer attached to the "
                      f"session again and the model now holds its parameters (version {self.version}).",
                      stacklevel=3)
