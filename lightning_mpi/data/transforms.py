"""Image transforms that Theano-MPI applied while loading: mean subtraction, random crop, mirror.

They are small callables on ``torch`` tensors laid out ``(..., H, W)`` (``CHW`` images, or a
stack of them), meant to run on the loader side of :class:`lightning_mpi.PrefetchDataModule`.

Randomness is deterministic without any global RNG. The loader derives one seed per
``(seed, epoch, sample index)`` (:func:`derive_seed`) and installs it for the current thread
while it loads that sample (:func:`sample_seed`); the random transforms draw from
:func:`current_generator`. A sample therefore gets the same crop and mirror in every run,
whatever the number of loader threads or the order in which they ran. Because the seed depends
on the sample and not on the rank, it also stays the same at any world size. Called outside a
loader (no seed installed), a random transform draws from its own generator, seeded by its
``seed`` argument, so it is still reproducible.

The global torch RNG is never touched: loader threads run concurrently with the training step,
and drawing from the shared global generator there would make both sides nondeterministic.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "CenterCrop",
    "Compose",
    "MeanSubtract",
    "RandomCrop",
    "RandomMirror",
    "current_generator",
    "derive_seed",
    "sample_seed",
]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # SplitMix64 finaliser: a cheap, well-mixed bijection on 64-bit integers, so nearby inputs
    # (consecutive sample indices, epochs) give unrelated seeds.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*values: int) -> int:
    """A 63-bit seed that depends on every value in ``values`` and on their order.

    ``derive_seed(seed, epoch, index)`` is what the loader installs for one sample.
    """
    h = 0x6A09E667F3BCC908
    for v in values:
        h = _splitmix64(h ^ (int(v) & _MASK64))
    return h >> 1  # torch.Generator.manual_seed accepts at most 2**63 - 1 without wrapping


_local = threading.local()


@contextlib.contextmanager
def sample_seed(seed: int) -> Iterator[None]:
    """Install ``seed`` as this thread's transform seed for the duration of the block.

    The generator is built lazily on the first :func:`current_generator` call, so deterministic
    pipelines pay nothing for it.
    """
    previous = getattr(_local, "state", None)
    _local.state = [seed, None]
    try:
        yield
    finally:
        _local.state = previous


def current_generator() -> torch.Generator | None:
    """The generator seeded for the sample this thread is loading, or ``None`` outside a loader."""
    state = getattr(_local, "state", None)
    if state is None:
        return None
    if state[1] is None:
        state[1] = torch.Generator().manual_seed(state[0])
    return state[1]


def _check_image(img: Any, name: str) -> torch.Tensor:
    if not isinstance(img, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor image laid out (..., H, W), got {type(img).__name__}")
    if img.dim() < 2:
        raise ValueError(f"{name} expects an image with at least 2 dims (..., H, W), got shape {tuple(img.shape)}")
    return img


def _pair(size: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(size, bool):
        raise ValueError(f"{name}: size must be an int >= 1 or a pair of them, got {size!r}")
    pair: tuple[int, ...]
    if isinstance(size, int):
        pair = (size, size)
    else:
        try:
            pair = tuple(int(s) for s in size)
        except TypeError:
            raise ValueError(f"{name}: size must be an int >= 1 or a pair of them, got {size!r}") from None
        if len(pair) != 2:
            raise ValueError(f"{name}: size must be an int >= 1 or a pair (height, width), got {size!r}")
    if min(pair) < 1:
        raise ValueError(f"{name}: size must be >= 1 in both dims, got {size!r}")
    return pair[0], pair[1]


class _Random:
    """Holds the fallback generator used when no per-sample seed is installed."""

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{type(self).__name__}: seed must be an int >= 0, got {seed!r}")
        self.seed = seed
        self._fallback = torch.Generator().manual_seed(seed)
        # The fallback generator is shared state; a lock keeps direct multi-threaded use safe.
        self._lock = threading.Lock()

    def _randint(self, high: int) -> int:
        """Uniform integer in [0, high)."""
        g = current_generator()
        if g is not None:
            return int(torch.randint(high, (1,), generator=g))
        with self._lock:
            return int(torch.randint(high, (1,), generator=self._fallback))

    def _rand(self) -> float:
        g = current_generator()
        if g is not None:
            return float(torch.rand((), generator=g))
        with self._lock:
            return float(torch.rand((), generator=self._fallback))


class MeanSubtract:
    """``image.float() - mean``: Theano-MPI's mean-image subtraction.

    Args:
        mean: a full mean image (``C×H×W``, as Theano-MPI stored it), a per-channel mean (a
            sequence of ``C`` floats or a ``C``-element tensor, broadcast over ``H×W``), or a
            scalar. It must broadcast against the images it is applied to; apply a full mean
            image before cropping.
        dtype: floating dtype of the result (integer images are converted first).
    """

    def __init__(self, mean: torch.Tensor | Sequence[float] | float, dtype: torch.dtype = torch.float32) -> None:
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"MeanSubtract: dtype must be a floating torch.dtype, got {dtype!r}")
        m = torch.as_tensor(mean, dtype=dtype)
        if m.dim() == 1:
            if m.numel() == 0:
                raise ValueError("MeanSubtract: mean must have at least one element, got an empty sequence")
            m = m.reshape(-1, 1, 1)  # per-channel: broadcast over H and W
        if not torch.isfinite(m).all():
            raise ValueError("MeanSubtract: mean must be finite, got NaN or inf entries")
        self.mean = m
        self.dtype = dtype

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        img = _check_image(img, "MeanSubtract")
        try:
            return img.to(self.dtype) - self.mean
        except RuntimeError as err:
            raise ValueError(
                f"MeanSubtract: mean of shape {tuple(self.mean.shape)} does not broadcast to image "
                f"shape {tuple(img.shape)}"
            ) from err

    def __repr__(self) -> str:
        return f"MeanSubtract(mean_shape={tuple(self.mean.shape)}, dtype={self.dtype})"


class RandomCrop(_Random):
    """Crop a ``size`` window at a uniformly random offset (Theano-MPI's random crop).

    Args:
        size: output ``(height, width)``, or one int for a square crop.
        seed: seed of the fallback generator used outside a loader.

    Returns a view into the input; collation copies it.
    """

    def __init__(self, size: int | Sequence[int], seed: int = 0) -> None:
        super().__init__(seed)
        self.size = _pair(size, "RandomCrop")

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        img = _check_image(img, "RandomCrop")
        h, w = img.shape[-2:]
        ch, cw = self.size
        if ch > h or cw > w:
            raise ValueError(f"RandomCrop: crop {ch}x{cw} is larger than the image {h}x{w}")
        top = self._randint(h - ch + 1)
        left = self._randint(w - cw + 1)
        return img[..., top : top + ch, left : left + cw]

    def __repr__(self) -> str:
        return f"RandomCrop(size={self.size}, seed={self.seed})"


class CenterCrop:
    """Crop the central ``size`` window: the evaluation counterpart of :class:`RandomCrop`."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _pair(size, "CenterCrop")

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        img = _check_image(img, "CenterCrop")
        h, w = img.shape[-2:]
        ch, cw = self.size
        if ch > h or cw > w:
            raise ValueError(f"CenterCrop: crop {ch}x{cw} is larger than the image {h}x{w}")
        top = (h - ch) // 2
        left = (w - cw) // 2
        return img[..., top : top + ch, left : left + cw]

    def __repr__(self) -> str:
        return f"CenterCrop(size={self.size})"


class RandomMirror(_Random):
    """Flip the image left-right (along W) with probability ``p`` (Theano-MPI's mirror).

    Args:
        p: flip probability, in [0, 1].
        seed: seed of the fallback generator used outside a loader.
    """

    def __init__(self, p: float = 0.5, seed: int = 0) -> None:
        super().__init__(seed)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomMirror: p must be a float in [0, 1], got {p!r}")
        self.p = float(p)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        img = _check_image(img, "RandomMirror")
        # Always draw, even for p in {0, 1}, so the generator stream of later transforms does not
        # depend on p.
        if self._rand() < self.p:
            return torch.flip(img, dims=(-1,))
        return img

    def __repr__(self) -> str:
        return f"RandomMirror(p={self.p}, seed={self.seed})"


class Compose:
    """Apply ``transforms`` in order."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        transforms = list(transforms)
        for i, t in enumerate(transforms):
            if not callable(t):
                raise ValueError(f"Compose: transforms[{i}] must be callable, got {type(t).__name__}")
        self.transforms = transforms

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x

    def __repr__(self) -> str:
        return "Compose([" + ", ".join(repr(t) for t in self.transforms) + "])"
