"""examples/digits_data.py: the digits of scikit-learn's ``load_digits``, stored, and the held-out
split of its ``train_test_split(test_size=0.25, random_state=0, stratify=y)``.

The figures below were read off scikit-learn 1.9.1 when the file was stored; with scikit-learn
installed, the arrays are also compared with it."""
import importlib.util

import numpy as np
import pytest

from examples.digits_data import held_out_split, load_digits


def test_the_stored_digits_are_scikit_learns():
    x, y = load_digits()
    assert x.shape == (1797, 64) and x.dtype == np.float64 and y.shape == (1797,) and y.dtype == np.int64
    assert x.min() == 0 and x.max() == 16 and x.sum() == 561718
    assert np.bincount(y).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    if importlib.util.find_spec("sklearn") is not None:
        from sklearn.datasets import load_digits as sklearn_digits

        theirs = sklearn_digits(return_X_y=True)
        assert np.array_equal(x, theirs[0]) and np.array_equal(y, theirs[1])


def test_the_held_out_split_is_stratified_disjoint_and_whole():
    x, y = load_digits()
    rows = np.arange(len(y))
    train, test, y_train, y_test = held_out_split(rows, y)
    assert len(train) == 1347 and len(test) == 450
    assert sorted(np.concatenate([train, test]).tolist()) == rows.tolist()
    assert np.array_equal(y_train, y[train]) and np.array_equal(y_test, y[test])
    # stratified: each class holds a quarter of its images out, to one image
    assert np.all(np.abs(np.bincount(y_test) - np.bincount(y) / 4) <= 1)
    if importlib.util.find_spec("sklearn") is not None:
        from sklearn.model_selection import train_test_split

        theirs = train_test_split(x / 16.0, y, test_size=0.25, random_state=0, stratify=y)
        assert all(np.array_equal(a, b) for a, b in zip(held_out_split(x / 16.0, y), theirs, strict=True))


def test_arrays_of_another_length_are_refused_naming_the_fix():
    x, y = load_digits()
    with pytest.raises(ValueError, match="x has 1797 rows and y 10"):
        held_out_split(x, y[:10])
    with pytest.raises(ValueError, match="pass the arrays load_digits"):
        held_out_split(x[:10], y[:10])
