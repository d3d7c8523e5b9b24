"""A Hugging Face ``transformers.Trainer`` driving a RemoteOptimizer (issue 56), against the same
Trainer with ``torch.optim.AdamW`` in process.

The Trainer gets ``optimizers=(RemoteOptimizer(...), get_cosine_schedule_with_warmup(opt, 10, N))``:
the warmup starts at a learning rate of 0, which the server must take. It saves a checkpoint every
N/2 steps (``optimizer.pt`` is ``RemoteOptimizer.state_dict()``), and a run resumed from the first
one (``trainer.train(resume_from_checkpoint=...)`` with a fresh model, initialised differently, and
a fresh RemoteOptimizer naming the same session, as a restarted script would) must log the losses
of the uninterrupted run, whether the session is then ahead of the checkpoint (it trained on to N),
closed, or gone with a restarted server. Tiny GPT-2 from a config, synthetic tokens, CPU, offline.
"""

from __future__ import annotations

import uuid
import warnings

import pytest
import torch

from tests._trainer_helpers import (BATCH, TOLERANCE, RestartableServer, TokenData, adamw_spec, close_quietly,
                                    max_loss_difference, max_parameter_difference, named_groups, parameters_of,
                                    tiny_gpt2, torch_adamw)

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments, get_cosine_schedule_with_warmup  # noqa: E402

from optserve.client import Client  # noqa: E402
from optserve.client.errors import NotFoundError  # noqa: E402
from optserve.client.torch import RemoteOptimizer  # noqa: E402

STEPS, WARMUP = 40, 10
SAVE = STEPS // 2
RESUMED_STEPS = range(SAVE + 1, STEPS + 1)
DATA = TokenData(STEPS * BATCH)  # one epoch of N steps, shuffled by the Trainer's seeded sampler
MODEL_SEED, OTHER_SEED = 0, 1  # a resumed run starts from another initialisation: only the checkpoint can fix it


class LossLog(TrainerCallback):
    """Each step's training loss, by global step (``logging_steps=1``: the loss of that step alone)."""

    def __init__(self):
        self.losses: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])


def _train(model, optimizer, output_dir, resume_from=None) -> dict[int, float]:
    """A Trainer run of STEPS steps (checkpoints every SAVE), from ``resume_from`` if given; its losses."""
    args = TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             save_strategy="steps", save_steps=SAVE, logging_steps=1, report_to=[], use_cpu=True,
                             seed=0, dataloader_num_workers=0, disable_tqdm=True)
    log = LossLog()
    scheduler = get_cosine_schedule_with_warmup(optimizer, WARMUP, STEPS)
    trainer = Trainer(model=model, args=args, train_dataset=DATA, optimizers=(optimizer, scheduler), callbacks=[log])
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    return log.losses


def _remote(model, address, session) -> RemoteOptimizer:
    return RemoteOptimizer(named_groups(model), address, adamw_spec(), session=session)


def _session_version(address, name) -> int:
    with Client(address) as client:
        return client.session(name).status().version


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The uninterrupted run with torch.optim.AdamW: ``(losses by step, final parameters)``."""
    model = tiny_gpt2(MODEL_SEED)
    losses = _train(model, torch_adamw(model), tmp_path_factory.mktemp("hf-torch"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses, parameters_of(model)


class FirstRun:
    """An uninterrupted RemoteOptimizer run: its losses, checkpoints and optimizer (session at N)."""

    def __init__(self, address, session, output_dir):
        self.address, self.session_name, self.output_dir = address, session, output_dir
        self.model = tiny_gpt2(MODEL_SEED)
        self.optimizer = _remote(self.model, address, session)
        self.losses = _train(self.model, self.optimizer, output_dir)

    @property
    def checkpoint(self):
        return self.output_dir / f"checkpoint-{SAVE}"

    def check_against(self, baseline) -> float:
        """The run's largest loss difference from the baseline (asserted within TOLERANCE), and its
        final parameters close to the baseline's."""
        losses, params = baseline
        worst = max_loss_difference(self.losses, losses, range(1, STEPS + 1))
        assert worst <= TOLERANCE, f"uninterrupted run: max loss difference {worst:.3g}"
        assert max_parameter_difference(self.model, params) <= TOLERANCE
        assert self.optimizer.version == STEPS and (self.checkpoint / "optimizer.pt").is_file()
        return worst


def _resume(address, session, checkpoint, output_dir, attaches_at=None) -> tuple[dict, torch.nn.Module, object]:
    """A restarted script: a fresh model (another initialisation), a fresh RemoteOptimizer naming
    ``session`` (``attaches_at``: the version of the session it attaches to, which it warns about;
    None: it creates the session), and the Trainer resumed from ``checkpoint``."""
    model = tiny_gpt2(OTHER_SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = _remote(model, address, session)
    attached = [w for w in caught if "already existed" in str(w.message)]
    assert optimizer.created == (attaches_at is None) and len(attached) == (attaches_at is not None), caught
    if attaches_at is not None:
        assert f"at version {attaches_at}:" in str(attached[0].message)
    return _train(model, optimizer, output_dir, resume_from=checkpoint), model, optimizer


def _check_resumed(losses, model, optimizer, baseline, first: FirstRun, case: str) -> None:
    """The resumed run's losses and final parameters against the torch.optim.AdamW run (and,
    printed, against the uninterrupted RemoteOptimizer run)."""
    reference, params = baseline
    assert sorted(losses) == list(RESUMED_STEPS)
    worst = max_loss_difference(losses, reference, RESUMED_STEPS)
    from_first = max_loss_difference(losses, first.losses, RESUMED_STEPS)
    print(f"\nhf: max loss difference {worst:.3g} (resumed, {case}); {from_first:.3g} from the uninterrupted "
          f"RemoteOptimizer run")
    assert worst <= TOLERANCE, f"resumed run: max loss difference {worst:.3g} ({losses} vs {reference})"
    assert from_first <= TOLERANCE
    assert max_parameter_difference(model, params) <= TOLERANCE
    assert optimizer.version == STEPS


@pytest.fixture(scope="module")
def first_run(server, tmp_path_factory):
    """The uninterrupted RemoteOptimizer run the plain, session-ahead and by-hand tests share (the
    last two leave its session at N, or do not touch it)."""
    run = FirstRun(server.address, "hf-first-run-" + uuid.uuid4().hex[:8], tmp_path_factory.mktemp("hf-first"))
    yield run
    close_quietly(run.optimizer)


def test_a_plain_run_from_a_warmup_at_zero_equals_torch_adamw(first_run, baseline):
    worst = first_run.check_against(baseline)
    print(f"\nhf: max loss difference {worst:.3g} (uninterrupted)")


def test_resumed_from_the_older_checkpoint_while_the_session_is_ahead(first_run, baseline, server, tmp_path):
    first_run.check_against(baseline)
    assert _session_version(server.address, first_run.session_name) == STEPS  # ahead of checkpoint-N/2
    losses, model, optimizer = _resume(server.address, first_run.session_name, first_run.checkpoint,
                                       tmp_path / "resumed", attaches_at=STEPS)
    try:
        _check_resumed(losses, model, optimizer, baseline, first_run, "session ahead")
        # The first run's optimizer is still attached to the session the resume replaced, as another
        # worker would be: its next step is refused and dropped, and it attaches again, its model
        # holding the resumed run's parameters.
        stale = first_run.optimizer
        first_run.model(**DATA[0:BATCH]).loss.backward()
        with pytest.warns(UserWarning, match="was replaced"):
            stale.step()
        assert stale.version == STEPS and stale.stale_pushes == 1
        resumed = dict(model.named_parameters())
        for name, p in first_run.model.named_parameters():
            assert torch.equal(p, resumed[name]), name
    finally:
        close_quietly(optimizer)


def test_resumed_after_the_session_was_closed(server, baseline, unique_name, tmp_path):
    run = FirstRun(server.address, unique_name, tmp_path / "first")
    run.check_against(baseline)
    run.optimizer.session.close()
    with pytest.raises(NotFoundError):
        _session_version(server.address, unique_name)
    losses, model, optimizer = _resume(server.address, unique_name, run.checkpoint, tmp_path / "resumed")
    try:
        _check_resumed(losses, model, optimizer, baseline, run, "session closed")
    finally:
        close_quietly(optimizer)
        run.optimizer.close()


@pytest.fixture(scope="module")
def restartable_server(ray_local):
    running = RestartableServer()
    yield running
    running.stop()


def test_resumed_on_a_restarted_non_durable_server(restartable_server, baseline, unique_name, tmp_path):
    address = restartable_server.address
    run = FirstRun(address, unique_name, tmp_path / "first")
    run.check_against(baseline)
    run.optimizer.close()  # the script ends; then the server restarts, without the session
    restartable_server.restart()
    with pytest.raises(NotFoundError):
        _session_version(address, unique_name)
    losses, model, optimizer = _resume(address, unique_name, run.checkpoint, tmp_path / "resumed")
    try:
        _check_resumed(losses, model, optimizer, baseline, run, "restarted server")
    finally:
        close_quietly(optimizer)


@pytest.mark.parametrize("model_first", [True, False], ids=["model-then-optimizer", "optimizer-then-model"])
def test_a_checkpoint_loaded_by_hand_in_either_order_puts_model_and_session_there(first_run, server, unique_name,
                                                                                 model_first):
    """The checkpoint's files loaded without a Trainer, into a fresh model and a RemoteOptimizer on
    another session, model first (as Trainer and Lightning do) or optimizer first: the model and
    the session hold the checkpoint's parameters and optimizer state at its version, and the
    optimizer's next step trains the model's own tensors."""
    import safetensors.torch

    weights = safetensors.torch.load_file(str(first_run.checkpoint / "model.safetensors"))
    saved = torch.load(first_run.checkpoint / "optimizer.pt", weights_only=True)
    model = tiny_gpt2(OTHER_SEED)
    optimizer = _remote(model, server.address, unique_name)
    try:
        if model_first:
            model.load_state_dict(weights, strict=False)  # lm_head.weight is wte.weight (tied)
            optimizer.load_state_dict(saved)
        else:
            optimizer.load_state_dict(saved)
            model.load_state_dict(weights, strict=False)
        assert optimizer.version == SAVE and optimizer.session.status().version == SAVE
        pulled = optimizer.session.pull()
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), weights[name]), name
            assert torch.equal(torch.from_numpy(pulled[name]), weights[name]), name
        now = optimizer.state_dict()
        assert now["optserve"]["version"] == SAVE and now["param_groups"] == saved["param_groups"]
        assert sorted(now["state"]) == sorted(saved["state"])
        for index, leaves in saved["state"].items():
            assert sorted(now["state"][index]) == sorted(leaves)
            for path, value in leaves.items():
                assert torch.equal(now["state"][index][path], value), (index, path)
        model(**DATA[0:BATCH]).loss.backward()
        optimizer.step()
        pulled = optimizer.session.pull()
        assert optimizer.version == SAVE + 1
        for name, p in model.named_parameters():
            assert not torch.equal(p.detach(), weights[name]), name
            assert torch.equal(p.detach(), torch.from_numpy(pulled[name])), name
    finally:
        close_quietly(optimizer)
