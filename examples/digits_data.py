"""The digits data of the examples, tests and benchmarks, without scikit-learn.

``data/digits.npz`` holds the 1,797 8x8 images of scikit-learn's ``load_digits`` (the test set of
the UCI "Optical Recognition of Handwritten Digits" data, E. Alpaydin and C. Kaynak, 1998,
CC BY 4.0), as scikit-learn 1.9.1 returns them, and the held-out split that scikit-learn's
``train_test_split(test_size=0.25, random_state=0, stratify=y)`` gives, computed once with it.

Why not scikit-learn itself: it brings SciPy, and torchmetrics (which Lightning imports) imports
``scipy.signal`` whenever SciPy is installed, about 1.4 s of CPU in every process that imports
Lightning, in every rank of every launch, whether it trains on digits or not.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["DIGITS_PATH", "held_out_split", "load_digits"]

#: The stored arrays (see the module docstring).
DIGITS_PATH = Path(__file__).resolve().parent / "data" / "digits.npz"


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` as scikit-learn's ``load_digits(return_X_y=True)``: ``x`` float64 of shape
    (1797, 64), pixel values 0..16; ``y`` int64 labels 0..9."""
    with np.load(DIGITS_PATH) as stored:
        return stored["images"].astype(np.float64), stored["labels"].astype(np.int64)


def held_out_split(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, x_test, y_train, y_test)``: the rows of ``x`` and ``y`` (1,797 each, in
    ``load_digits`` order) that scikit-learn's ``train_test_split(x, y, test_size=0.25,
    random_state=0, stratify=y)`` returns, in its order (1,347 to train, 450 held out)."""
    if len(x) != len(y):
        raise ValueError(f"held_out_split: x has {len(x)} rows and y {len(y)}; pass both from load_digits()")
    with np.load(DIGITS_PATH) as stored:
        train, test = stored["held_out_train"].astype(np.int64), stored["held_out_test"].astype(np.int64)
    if len(x) != len(train) + len(test):
        raise ValueError(
            f"held_out_split: x has {len(x)} rows, the stored split is of {len(train) + len(test)}; "
            "pass the arrays load_digits() returns"
        )
    return x[train], x[test], y[train], y[test]
