"""Lightning driving a RemoteOptimizer (issue 56), against the same LightningModule with
``torch.optim.AdamW`` in process.

``configure_optimizers`` returns the RemoteOptimizer with a warmup-from-0 cosine schedule stepped
every step; a ModelCheckpoint saves every N/2 steps (``optimizer_states`` holds
``RemoteOptimizer.state_dict()``), and ``trainer.fit(module, ckpt_path=...)`` with a fresh module
(initialised differently, naming the same session, as a restarted script's would) must train on
exactly as the uninterrupted run did. Lightning restores the model's weights first, then calls
``configure_optimizers`` (whose RemoteOptimizer attaches to the session, which is ahead, and loads
its parameters into the model) and then ``optimizer.load_state_dict``.

Epochs are N/2 steps long and the data is not shuffled: Lightning resumes a plain DataLoader
exactly only from an end-of-epoch checkpoint (mid-epoch it warns and starts the epoch's data over).
"""

from __future__ import annotations

import glob
import warnings

import pytest
import torch

from tests._trainer_helpers import (BATCH, TOLERANCE, TokenData, adamw_spec, close_quietly, max_loss_difference,
                                    max_parameter_difference, named_groups, parameters_of, tiny_gpt2, torch_adamw)

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from transformers import get_cosine_schedule_with_warmup  # noqa: E402

from optserve.client import Client  # noqa: E402
from optserve.client.errors import NotFoundError  # noqa: E402
from optserve.client.torch import RemoteOptimizer  # noqa: E402

STEPS, WARMUP = 40, 10
SAVE = STEPS // 2
RESUMED_STEPS = range(SAVE + 1, STEPS + 1)
DATA = TokenData(SAVE * BATCH)  # an epoch is N/2 steps: the checkpoint at N/2 ends one
MODEL_SEED, OTHER_SEED = 0, 1


class TinyLM(L.LightningModule):
    """The tiny GPT-2; ``make_optimizer(module)`` is its optimizer. ``losses``: each step's loss,
    by global step (1-based), recorded in ``training_step``."""

    def __init__(self, seed: int, make_optimizer):
        super().__init__()
        self.model = tiny_gpt2(seed)
        self._make_optimizer = make_optimizer
        self.made_optimizer = None
        self.losses: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses[self.global_step + 1] = float(loss.detach())
        return loss

    def configure_optimizers(self):
        self.made_optimizer = self._make_optimizer(self)
        scheduler = get_cosine_schedule_with_warmup(self.made_optimizer, WARMUP, STEPS)
        return {"optimizer": self.made_optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(DATA, batch_size=BATCH, shuffle=False, num_workers=0)


def _fit(module, checkpoint_dir, ckpt_path=None) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[ModelCheckpoint(dirpath=str(checkpoint_dir), every_n_train_steps=SAVE,
                                                   save_top_k=-1)])
    with warnings.catch_warnings():
        # a tiny model on a CPU: Lightning suggests more dataloader workers
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", "Checkpoint directory .* exists and is not empty")  # a resume saves there too
        trainer.fit(module, ckpt_path=None if ckpt_path is None else str(ckpt_path))


def _remote(address, session):
    return lambda module: RemoteOptimizer(named_groups(module.model), address, adamw_spec(), session=session)


def _checkpoint_at(checkpoint_dir, step: int) -> str:
    found = glob.glob(str(checkpoint_dir / f"*step={step}.ckpt"))
    assert len(found) == 1, (step, sorted(glob.glob(str(checkpoint_dir / "*"))))
    return found[0]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    module = TinyLM(MODEL_SEED, lambda m: torch_adamw(m.model))
    _fit(module, tmp_path_factory.mktemp("lightning-torch"))
    assert sorted(module.losses) == list(range(1, STEPS + 1))
    return module.losses, parameters_of(module.model)


@pytest.fixture
def first_run(server, unique_name, tmp_path):
    module = TinyLM(MODEL_SEED, _remote(server.address, unique_name))
    _fit(module, tmp_path / "first")
    yield module, tmp_path / "first"
    close_quietly(module.made_optimizer)


def test_fit_and_resume_from_the_mid_checkpoint_while_the_session_is_ahead_equal_torch_adamw(
        first_run, baseline, server, unique_name):
    reference, params = baseline
    module, checkpoint_dir = first_run
    worst_first = max_loss_difference(module.losses, reference, range(1, STEPS + 1))
    assert worst_first <= TOLERANCE, f"uninterrupted run: max loss difference {worst_first:.3g}"
    assert max_parameter_difference(module.model, params) <= TOLERANCE
    with Client(server.address) as client:
        assert client.session(unique_name).status().version == STEPS  # ahead of the checkpoint

    resumed = TinyLM(OTHER_SEED, _remote(server.address, unique_name))
    try:
        with pytest.warns(UserWarning, match="already existed at version 40"):  # configure_optimizers attached
            _fit(resumed, checkpoint_dir, ckpt_path=_checkpoint_at(checkpoint_dir, SAVE))
        assert sorted(resumed.losses) == list(RESUMED_STEPS)
        worst = max_loss_difference(resumed.losses, reference, RESUMED_STEPS)
        from_first = max_loss_difference(resumed.losses, module.losses, RESUMED_STEPS)
        print(f"\nlightning: max loss difference {worst_first:.3g} uninterrupted, {worst:.3g} resumed (session ahead); "
              f"{from_first:.3g} from the uninterrupted RemoteOptimizer run")
        assert from_first <= TOLERANCE
        assert worst <= TOLERANCE, f"resumed run: max loss difference {worst:.3g}"
        assert max_parameter_difference(resumed.model, params) <= TOLERANCE
        assert resumed.made_optimizer.version == STEPS
    finally:
        close_quietly(resumed.made_optimizer)


def test_resume_after_the_session_was_closed_equals_torch_adamw(first_run, baseline, server, unique_name):
    reference, params = baseline
    module, checkpoint_dir = first_run
    module.made_optimizer.session.close()
    with Client(server.address) as client, pytest.raises(NotFoundError):
        client.session(unique_name)
    resumed = TinyLM(OTHER_SEED, _remote(server.address, unique_name))
    try:
        _fit(resumed, checkpoint_dir, ckpt_path=_checkpoint_at(checkpoint_dir, SAVE))
        assert resumed.made_optimizer.version == STEPS
        worst = max_loss_difference(resumed.losses, reference, RESUMED_STEPS)
        from_first = max_loss_difference(resumed.losses, module.losses, RESUMED_STEPS)
        print(f"\nlightning: max loss difference {worst:.3g} resumed (session closed); {from_first:.3g} from the "
              f"uninterrupted RemoteOptimizer run")
        assert from_first <= TOLERANCE
        assert worst <= TOLERANCE, f"resumed run: max loss difference {worst:.3g}"
        assert max_parameter_difference(resumed.model, params) <= TOLERANCE
    finally:
        close_quietly(resumed.made_optimizer)
