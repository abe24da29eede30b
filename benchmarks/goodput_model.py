"""What every arm of benchmarks/goodput.py trains, without Lightning: the data, the model, the stop
request and the digest of the final weights.

Both workers import it (``goodput_worker.py``, Lightning, for our arms and ``ddp_torchrun``;
``goodput_torchft.py``, a plain torch loop, for torchft's arms), so that every arm trains the same
MLP on the same synthetic set with the same optimizer.

The benchmark ends a job at the end of its budget by writing ``OUT/stop``: one line, the global
step at which every process stops (far enough ahead that every rank reads it first); then each
process that finishes writes ``OUT/weights/<pid>``: ``rank step digest`` of its final weights, so
that the benchmark can tell whether the replicas ended identical.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

SAMPLES = 8192
FEATURES = 64
CLASSES = 10
WIDTH = 256
LR = 0.05
MOMENTUM = 0.9


def dataset() -> TensorDataset:
    """A fixed synthetic classification set: labels from a random linear teacher."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def mlp(width: int = WIDTH) -> nn.Sequential:
    """The model, initialised identically on every process (seed 0)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, CLASSES)
    )


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def digest(module: nn.Module) -> str:
    """A hash of the module's weights, bit for bit (in ``state_dict`` order)."""
    h = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class StopRequest:
    """Reads ``OUT/stop`` (the step to stop at) once it exists; cheap to poll every step."""

    def __init__(self, out: Path) -> None:
        self.path = out / "stop"
        self.step: int | None = None

    def due(self, step: int) -> bool:
        if self.step is None and self.path.exists():
            try:
                self.step = int(self.path.read_text().split()[0])
            except (ValueError, IndexError):  # being written: read it next time
                return False
        return self.step is not None and step >= self.step


def write_digest(out: Path, rank: int, step: int, module: nn.Module) -> None:
    (out / "weights").mkdir(parents=True, exist_ok=True)
    (out / "weights" / str(os.getpid())).write_text(f"{rank} {step} {digest(module)}\n")
