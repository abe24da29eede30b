"""The arms and the GPT-like model of ``benchmarks/offload.py`` (imported by its worker processes).

An arm is a ``+``-joined list of parts, each optionally with ``:key=value`` arguments:

* ``none``: plain training.
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around each training batch.
* ``torchtune``: torchtune's ``OffloadActivations()`` (its defaults: pinned memory, a side stream)
  around each training batch. Needs the ``torchtune`` and ``torchao`` packages (torchtune's own
  dependencies only if present: see :func:`torchtune_offload_activations`); without them the arm
  is reported as skipped.
* ``LMSOffload``: ``LMSOffload(target="cpu")`` on CUDA, ``target="disk"`` on CPU; arguments go to
  the constructor, e.g. ``LMSOffload:prefetch=4`` (the prefetch sweep).
* ``checkpoint``: non-reentrant activation checkpointing of every block (U-Net: each convolution
  block; GPT: each transformer block), alone or with one offloader: ``checkpoint+LMSOffload``.

Every offloader enters in ``on_train_batch_start`` and leaves in ``on_train_batch_end``, so it
covers forward and backward of each step.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

OFFLOADERS = ("save_on_cpu", "torchtune", "LMSOffload")
#: the arms the original three modes stand for, and issue 16's list on a GPU
DEFAULT_ARMS = ("none", "save_on_cpu", "LMSOffload")
GPU_ARMS = ("none", "save_on_cpu", "torchtune", "LMSOffload", "LMSOffload:prefetch=1", "LMSOffload:prefetch=4",
            "checkpoint", "checkpoint+save_on_cpu", "checkpoint+torchtune", "checkpoint+LMSOffload")


@dataclass
class Arm:
    name: str
    checkpoint: bool = False
    offloader: str | None = None
    kwargs: dict = field(default_factory=dict)


def parse_arm(name: str) -> Arm:
    """``"checkpoint+LMSOffload:prefetch=4"`` -> Arm; ``ValueError`` naming the bad part."""
    arm = Arm(name)
    for part in name.split("+"):
        base, _, args = part.partition(":")
        if base == "none" and "+" not in name:
            continue
        if base == "checkpoint" and not args:
            arm.checkpoint = True
        elif base in OFFLOADERS and arm.offloader is None:
            arm.offloader = base
            for item in filter(None, args.split(",")):
                key, _, value = item.partition("=")
                arm.kwargs[key] = int(value) if value.lstrip("-").isdigit() else value
        else:
            raise ValueError(f"arm={name!r}: part {part!r} is not one of none, checkpoint, {', '.join(OFFLOADERS)} "
                             "(at most one offloader; arguments only for offloaders, e.g. LMSOffload:prefetch=4)")
    return arm


def checkpoint_blocks(blocks) -> None:
    """Run every module in ``blocks`` under non-reentrant activation checkpointing."""
    for block in blocks:
        forward = block.forward
        block.forward = lambda *args, _forward=forward, **kwargs: checkpoint(_forward, *args, use_reentrant=False, **kwargs)


def blocks_of(net: nn.Module, model: str) -> list[nn.Module]:
    """What ``checkpoint`` wraps: the U-Net's convolution blocks, the GPT's transformer blocks, the
    MLP's Linear layers."""
    if model == "unet":
        return [net.enc1, net.enc2, net.bottom, net.dec2, net.dec1]
    if model == "gpt":
        return list(net.blocks)
    return [layer for layer in net if isinstance(layer, nn.Linear)]


def offloader_callbacks(arm: Arm, device: str, directory: str | None, pl):
    """``(callbacks, lms)`` for the arm's offloader; raises ``ImportError`` when torchtune is missing."""
    if arm.offloader is None:
        return [], None
    if arm.offloader == "LMSOffload":
        from lightning_mpi.offload import LMSOffload

        target = dict(target="cpu") if device == "cuda" else dict(target="disk", directory=directory)
        lms = LMSOffload(**target, **arm.kwargs)
        return [lms], lms
    if arm.offloader == "torchtune":
        offload_activations = torchtune_offload_activations()
        make = lambda: offload_activations(**arm.kwargs)  # noqa: E731
    else:
        make = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True, **arm.kwargs)  # noqa: E731

    class AroundEachBatch(pl.Callback):
        """Forward and backward of every step run inside the context."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.ctx = make()
            self.ctx.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ctx.__exit__(None, None, None)

    return [AroundEachBatch()], None


def torchtune_offload_activations():
    """torchtune's ``OffloadActivations`` class; ``ImportError`` when torchtune is not installed.

    ``import torchtune`` imports its datasets, models and tokenizers (``datasets``, ``omegaconf``,
    ``kagglehub``, ...). When those are missing (a GPU machine given only the torchtune and
    torchao wheels), the class is loaded from its own module file, which needs only torch,
    torchao and psutil: the same code, without the package's ``__init__``."""
    try:
        from torchtune.training import OffloadActivations

        return OffloadActivations
    except ImportError:
        spec = importlib.util.find_spec("torchtune")  # finds the package without running its __init__
        if spec is None or not spec.submodule_search_locations:
            raise
        path = Path(list(spec.submodule_search_locations)[0]) / "training" / "_activation_offloading.py"
        if not path.exists():
            raise
        module_spec = importlib.util.spec_from_file_location("_torchtune_activation_offloading", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)  # ImportError here when torchao or psutil is missing
        return module.OffloadActivations


# --- a plain GPT-like transformer ---------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (``scaled_dot_product_attention``), MLP 4x."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``depth`` blocks, a final norm and an untied output layer."""

    def __init__(self, vocab: int, width: int, depth: int, seq: int, heads: int | None = None) -> None:
        super().__init__()
        heads = heads or max(1, width // 64)
        if width % heads:
            raise ValueError(f"width={width} must be a multiple of heads={heads}")
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def pinned_snapshot(lms) -> dict:
    """Pinned host memory as torch's host allocator counts it, and LMSOffload's pool's own count."""
    out: dict = {}
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is not None:
        try:
            out["host_memory_stats"] = {k: v for k, v in stats().items() if "bytes" in k}
        except RuntimeError as error:  # no CUDA context, or a torch without host stats
            out["host_memory_stats_error"] = str(error)
    pool = getattr(getattr(lms, "_tier", None), "pool", None)
    if pool is not None:
        out["pool_reserved_bytes"] = pool.stats().reserved_bytes
    return out
