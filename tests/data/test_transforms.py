"""Tests for lightning_mpi.data.transforms: values, per-sample seeding, argument checks."""
from __future__ import annotations

import pytest
import torch

from lightning_mpi.data import transforms as T

pytestmark = pytest.mark.timeout(60)


def test_transforms_values():
    img = torch.arange(2 * 5 * 6, dtype=torch.float32).reshape(2, 5, 6)
    out = T.MeanSubtract([1.0, 2.0])(img)
    assert torch.equal(out[0], img[0] - 1) and torch.equal(out[1], img[1] - 2)
    assert torch.equal(T.MeanSubtract(img)(img), torch.zeros_like(img))  # a full mean image
    assert T.MeanSubtract(0.5)(img.to(torch.uint8)).dtype == torch.float32

    crop = T.RandomCrop((3, 4), seed=0)
    offsets = set()
    for _ in range(50):
        c = crop(img)
        assert c.shape == (2, 3, 4)
        top, left = divmod(int(c[0, 0, 0]), 6)
        assert torch.equal(c, img[:, top : top + 3, left : left + 4])
        offsets.add((top, left))
    assert len(offsets) > 3 and all(t <= 2 and l <= 2 for t, l in offsets)
    assert torch.equal(T.CenterCrop(3)(img), img[:, 1:4, 1:4])

    assert torch.equal(T.RandomMirror(1.0)(img), img.flip(-1))
    assert torch.equal(T.RandomMirror(0.0)(img), img)
    flips = sum(torch.equal(T.RandomMirror(0.5, seed=s)(img), img.flip(-1)) for s in range(200))
    assert 60 < flips < 140


def test_transforms_use_the_installed_sample_seed():
    img = torch.arange(3 * 8 * 8, dtype=torch.float32).reshape(3, 8, 8)
    tf = T.Compose([T.RandomCrop(5), T.RandomMirror()])
    with T.sample_seed(T.derive_seed(0, 1, 2)):
        a = tf(img)
    with T.sample_seed(T.derive_seed(0, 1, 2)):
        b = tf(img)
    assert torch.equal(a, b)
    outs = set()
    for idx in range(30):
        with T.sample_seed(T.derive_seed(0, 1, idx)):
            outs.add(tf(img).numpy().tobytes())
    assert len(outs) > 5
    assert T.current_generator() is None
    assert T.derive_seed(1, 2) != T.derive_seed(2, 1)


@pytest.mark.parametrize(
    "factory, match",
    [
        (lambda: T.RandomCrop(0), r"RandomCrop: size must be >= 1 in both dims, got 0"),
        (lambda: T.RandomCrop((2, 2, 2)), r"RandomCrop: size must be an int >= 1 or a pair"),
        (lambda: T.CenterCrop(-3), r"CenterCrop: size must be >= 1"),
        (lambda: T.RandomMirror(1.5), r"RandomMirror: p must be a float in \[0, 1\], got 1.5"),
        (lambda: T.RandomMirror(seed=-2), r"RandomMirror: seed must be an int >= 0, got -2"),
        (lambda: T.MeanSubtract([]), r"MeanSubtract: mean must have at least one element"),
        (lambda: T.MeanSubtract(1.0, dtype=torch.int32), r"MeanSubtract: dtype must be a floating"),
        (lambda: T.Compose([T.CenterCrop(2), 3]), r"Compose: transforms\[1\] must be callable"),
        (lambda: T.RandomCrop(9)(torch.zeros(3, 8, 8)), r"RandomCrop: crop 9x9 is larger than the image 8x8"),
        (lambda: T.MeanSubtract([1.0, 2.0])(torch.zeros(3, 4, 4)), r"does not broadcast"),
    ],
)
def test_transforms_reject_bad_arguments(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()
