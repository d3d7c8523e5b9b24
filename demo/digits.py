"""The demo's task: scikit-learn's bundled 8x8 digits (nothing is downloaded) and a small torch MLP.

Also used by the compression test (``tests/test_overlap_and_compression.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

HIDDEN = 64
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class DigitsSplit:
    """scikit-learn's digits: ``x_*`` float32 (n, 64) in [0, 1], ``y_*`` int64 (n,) in [0, 10)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> DigitsSplit:
    """The bundled 1797 digits, shuffled with ``seed`` and split into train / test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return DigitsSplit(x[train], y[train], x[test], y[test])


def make_model(seed: int = 0):
    """A 64 -> HIDDEN -> 10 ReLU MLP with deterministic initial weights (torch, float32)."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, NUM_CLASSES)
    )


def evaluate(model, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on ``x``, ``y``."""
    import torch

    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
        accuracy = (logits.argmax(dim=1).numpy() == y).mean().item()
    return float(loss), float(accuracy)
