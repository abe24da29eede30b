"""The time-to-quality task: a byte-level language model over the Python standard library's source.

The data ships with every Python: the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]``
(without ``site-packages``/``dist-packages``), sorted by relative path. Every ``held_out_every``-th
file is held out; the rest is the training text. Both are cut at a byte budget, so the run reads
the same bytes on every machine with the same Python version (the JSON records the version and a
digest of the bytes).

The model predicts byte ``t`` from the ``context`` bytes before it: an embedding (vocabulary 256)
flattened into a wide MLP, ``Linear(context*embed, hidden) -> GELU -> Linear(hidden, hidden) ->
GELU -> Linear(hidden, 256)``. It is cheap in compute and heavy in parameters (the defaults give
about 17M), so on a slow link the exchange, not the arithmetic, sets the pace.

Training samples are windows at random offsets drawn once from a fixed seed; every rank draws
the same windows and the Trainer's distributed sampler gives each rank its own shard. The
held-out set is a fixed list of evenly spaced windows of the held-out text.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

VOCAB = 256


@dataclass(frozen=True)
class TaskConfig:
    """Sizes of the data and the model (the defaults are the benchmark's; ``--smoke`` shrinks them)."""

    context: int = 64
    embed: int = 32
    hidden: int = 3072
    train_bytes: int = 8 << 20
    held_out_bytes: int = 512 << 10
    held_out_every: int = 10
    train_windows: int = 1 << 18
    held_out_windows: int = 512
    lr: float = 3e-4
    seed: int = 0


def stdlib_sources() -> list[Path]:
    """The standard library's ``*.py`` files, sorted by their path relative to the library root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts) and f.is_file()]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _concat(files: list[Path], limit: int) -> bytes:
    chunks, size = [], 0
    for f in files:
        if size >= limit:
            break
        data = f.read_bytes()
        chunks.append(data)
        size += len(data)
    text = b"".join(chunks)[:limit]
    if len(text) < limit:
        raise ValueError(f"the standard library holds only {len(text)} bytes for a split of {limit}; "
                         "lower train_bytes/held_out_bytes")
    return text


def load_texts(cfg: TaskConfig, cache: Path | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(training bytes, held-out bytes, sha256 of both) as uint8 tensors.

    With ``cache``: read them from that file if it exists, else build and save them there (the
    driver builds the file once, so each arm's ranks skip walking the library's 1,800 files).
    """
    if cache is not None and Path(cache).exists():
        saved = torch.load(cache)
        return saved["train"], saved["held_out"], saved["digest"]
    files = stdlib_sources()
    held = [f for i, f in enumerate(files) if i % cfg.held_out_every == 0]
    train = [f for i, f in enumerate(files) if i % cfg.held_out_every != 0]
    train_text, held_text = _concat(train, cfg.train_bytes), _concat(held, cfg.held_out_bytes)
    digest = hashlib.sha256(train_text + held_text).hexdigest()[:16]
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    train, held = as_tensor(train_text), as_tensor(held_text)
    if cache is not None:  # write, then rename: another run may be reading the same file
        partial = Path(f"{cache}.{os.getpid()}.partial")
        torch.save({"train": train, "held_out": held, "digest": digest}, partial)
        os.replace(partial, cache)
    return train, held, digest


class Windows(torch.utils.data.Dataset):
    """``(context bytes, next byte)`` pairs at fixed offsets of ``text``."""

    def __init__(self, text: torch.Tensor, offsets: torch.Tensor, context: int) -> None:
        self.text, self.offsets, self.context = text, offsets, context

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        o = int(self.offsets[i])
        window = self.text[o:o + self.context + 1].long()
        return window[:-1], window[-1]


def train_dataset(text: torch.Tensor, cfg: TaskConfig) -> Windows:
    """``train_windows`` windows at random offsets (seed ``cfg.seed``: the same on every rank)."""
    g = torch.Generator().manual_seed(cfg.seed)
    offsets = torch.randint(0, len(text) - cfg.context - 1, (cfg.train_windows,), generator=g)
    return Windows(text, offsets, cfg.context)


def held_out_batch(text: torch.Tensor, cfg: TaskConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed held-out set: ``held_out_windows`` evenly spaced windows, as one batch."""
    offsets = torch.linspace(0, len(text) - cfg.context - 2, cfg.held_out_windows).long()
    ds = Windows(text, offsets, cfg.context)
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    return torch.stack(xs), torch.stack(ys)


class ByteMLP(nn.Module):
    """Embedding of ``context`` bytes, flattened, then a wide two-hidden-layer MLP over 256 classes."""

    def __init__(self, cfg: TaskConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cfg.embed)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.context * cfg.embed, cfg.hidden), nn.GELU(),
            nn.Linear(cfg.hidden, cfg.hidden), nn.GELU(),
            nn.Linear(cfg.hidden, VOCAB),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(x).flatten(1))


def make_module(cfg: TaskConfig):
    """The LightningModule (``pytorch_lightning``): :class:`ByteMLP` trained with fused AdamW at ``cfg.lr``.

    Built from seed ``cfg.seed``, so every rank and every arm starts from the same weights.
    """
    import pytorch_lightning as pl

    class ByteLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(cfg.seed)
            self.net = ByteMLP(cfg)

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=cfg.lr, fused=True)  # one kernel: several times faster on CPU

    return ByteLM()


@torch.no_grad()
def held_out_loss(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], chunk: int = 256) -> float:
    """Mean cross-entropy (nats per byte) of ``net`` on the held-out batch."""
    x, y = batch
    total = 0.0
    for i in range(0, len(x), chunk):
        total += float(nn.functional.cross_entropy(net(x[i:i + chunk]), y[i:i + chunk], reduction="sum"))
    return total / len(x)
