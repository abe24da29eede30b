"""Run on 2 ranks: every exchange rule for many steps on a tiny model, measuring resource growth.

Usage: ``mpiexec -n 2 python tests/scripts/long_run.py OUT.json [--steps 5000] [--warmup 500]
[--every 1500] [--rules a,b,...] [--trainer-steps 0] [--trainer-strategies mpi_asa16,mpi_downpour]``.
Rank 0 writes every rank's records to ``OUT.json``.

The rules are driven directly, in the order :class:`~lightning_mpi.strategies.trainer.strategy.TrainerMPIStrategy` calls
them (a Trainer costs milliseconds per step, which 5,000 steps of 16 rules cannot afford on two
loaded cores): ``bind`` → ``on_train_start`` → per step {zero_grad, forward, backward,
``before_step``; if it accepts: ``optimizer.step()``, ``after_step``} → ``on_train_end`` →
``close``. After ``--warmup`` steps, and then at regular intervals, each rank samples:

- ``rss_kib``: resident set size (``/proc/self/statm``);
- ``py_blocks``: blocks held by Python's allocator (``sys.getallocatedblocks``): Python objects
  that pile up (one per step or per commit makes thousands of blocks, far below RSS noise in
  bytes); a container that only grows its one buffer (a list of small ints) shows in neither;
- ``threads``: ``/proc/self/task`` entries (every OS thread, MPI's and torch's included) and
  ``threading.active_count()``;
- ``fds``: open file descriptors (``/proc/self/fd``);
- ``mpi_handles``: live (non-null) mpi4py ``Comm``/``Win``/``Request``/``Group``/``Datatype``/
  ``Op``/``Info``/``Errhandler`` objects reachable from Python (see :func:`live_mpi_handles` for
  what that does and does not see);
- ``remote_accumulates`` (parameter-server rules): accumulates sent to other ranks so far, for
  the allowance on MPICH's own leak (see ``lightning_mpi/comm/window.py``).

Each rule's record holds the samples, the baseline before ``bind`` and the values after
``close()``; the test asserts on them. ``--trainer-steps`` adds Trainer-level runs of one sync
and one asynchronous strategy (resources sampled from a callback).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import threading
import time
import types
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")
from mpi4py import MPI  # noqa: E402

from lightning_mpi.comm.transport import Transport  # noqa: E402
from lightning_mpi.rules.averaging import ModelAveragingRule  # noqa: E402
from lightning_mpi.rules.compressed import CompressedSyncRule  # noqa: E402
from lightning_mpi.rules.easgd import EASGDRule  # noqa: E402
from lightning_mpi.rules.gossip import GoSGDRule  # noqa: E402
from lightning_mpi.rules.server import ADAGRule, AEASGDRule, AGNRule, DownpourRule, DynSGDRule, EAMSGDRule  # noqa: E402
from lightning_mpi.rules.sync import SyncRule  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024

#: name -> rule factory (every registered rule, with its default hyperparameters unless noted)
RULES = {
    "allreduce": lambda: SyncRule(exchange="allreduce"),
    "asa": lambda: SyncRule(exchange="asa"),
    "asa16": lambda: SyncRule(exchange="asa", wire="fp16"),
    "asa_bf16": lambda: SyncRule(exchange="asa", wire="bf16"),
    "int8": lambda: CompressedSyncRule(wire="int8"),
    "topk": lambda: CompressedSyncRule(wire="topk"),
    "onebit": lambda: CompressedSyncRule(wire="onebit"),
    "easgd": lambda: EASGDRule(),
    "model_avg": lambda: ModelAveragingRule(),
    "aeasgd": lambda: AEASGDRule(),
    "eamsgd": lambda: EAMSGDRule(),
    "downpour": lambda: DownpourRule(),
    "agn": lambda: AGNRule(),
    "adag": lambda: ADAGRule(),
    "dynsgd": lambda: DynSGDRule(),
    "gosgd": lambda: GoSGDRule(),
}

_HANDLE_TYPES = (MPI.Comm, MPI.Win, MPI.Request, MPI.Group, MPI.Datatype, MPI.Op, MPI.Info, MPI.Errhandler)


# -- measurements ------------------------------------------------------------------------------------
def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_KIB


def live_mpi_handles(*roots: object) -> dict[str, int]:
    """Non-null mpi4py handle objects reachable from ``roots`` and lightning_mpi's module globals, by type.

    A breadth-first walk over ``gc.get_referents`` from the bound rule and the transport (and every
    ``lightning_mpi`` module, for caches kept in globals). It does not descend into other modules,
    classes or function globals (torch, numpy and Lightning hold no handles of ours, and walking
    them costs seconds), only into instances, containers, closures and tensors' references.
    Predefined handles (``COMM_WORLD``, ``FLOAT``, ``SUM``, ...) are left out.

    What this sees: handles a rule still holds after ``close()`` (not freed), and handles that pile
    up per step while it runs (a list of requests never reaped, a communicator per exchange). What
    it cannot see: a handle whose Python object was dropped without ``Free()``: that leaks inside
    MPI only, and shows up here only indirectly (RSS; MPICH also runs out of communicator context
    ids after a few thousand leaked communicators, which fails loudly).
    """
    own_modules = [m for name, m in sys.modules.items() if name.startswith("lightning_mpi") and m is not None]
    stack = [*roots, *(vars(m) for m in own_modules)]
    seen: set[int] = set()
    found: dict[int, object] = {}
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, _HANDLE_TYPES):
            found[id(obj)] = obj
            continue
        if isinstance(obj, (types.ModuleType, type)):
            continue
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in (obj.__closure__ or ()) if _has_contents(c))
            stack.extend(obj.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(obj))
    counts: dict[str, int] = {}
    for obj in found.values():
        if not obj or getattr(obj, "handle", None) in _PREDEFINED:
            continue
        kind = next(t.__name__ for t in _HANDLE_TYPES if isinstance(obj, t))
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _has_contents(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


_PREDEFINED: set[int] = set()


def _collect_predefined() -> None:
    """MPI's own constants (COMM_WORLD, FLOAT, SUM, ...): never ours to free."""
    for name in dir(MPI):
        value = getattr(MPI, name)
        if isinstance(value, _HANDLE_TYPES) and value:
            _PREDEFINED.add(value.handle)


def settle_threads(expected: int, timeout: float = 2.0) -> None:
    """Wait (up to ``timeout`` s) until at most ``expected`` OS threads remain.

    ``Thread.join()`` returns when the thread's Python part is done; the OS thread still unwinds
    for a moment after that and stays listed in ``/proc/self/task`` meanwhile."""
    deadline = time.monotonic() + timeout
    while len(os.listdir("/proc/self/task")) > expected and time.monotonic() < deadline:
        time.sleep(0.01)


def sample(*roots: object) -> dict[str, object]:
    """One measurement of this process (see the module docstring); ``roots``: where handles live."""
    gc.collect()  # cheap: everything alive at start-up was frozen out of the collector (main)
    return {
        "rss_kib": rss_kib(),
        "py_blocks": sys.getallocatedblocks(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "py_threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "mpi_handles": live_mpi_handles(*roots),
    }


# -- the direct loop ---------------------------------------------------------------------------------
class Tiny(nn.Module):
    """A linear layer (weight and bias, 36 values): a step costs ~0.15 ms of compute, so the
    exchange, not the model, sets the pace of 5,000 steps of 16 rules."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # identical on every rank, as after the strategy's broadcast
        self.weight = nn.Parameter(torch.randn(8, 4) * 0.1)
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


def tiny_model() -> nn.Module:
    return Tiny()


def batches(count: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed pool of batches per rank (allocated once, so the loop itself allocates nothing new).

    Targets carry noise: the model cannot fit them exactly, so gradients never decay into
    denormal floats (which are ~100x slower to compute with)."""
    g = torch.Generator().manual_seed(100 + RANK)
    teacher = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(count):
        x = torch.randn(16, 8, generator=g)
        out.append((x, x @ teacher + 0.3 * torch.randn(16, 4, generator=g)))
    return out


def run_rule(name: str, transport: Transport, steps: int, warmup: int, every: int) -> dict[str, object]:
    """Drive one rule for ``steps`` steps; sample resources after ``warmup`` and then every ``every``."""
    pool = batches()
    baseline = sample(transport)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    params = [p for p in model.parameters() if p.requires_grad]
    bound = RULES[name]().bind(transport, params)
    bound.on_train_start()
    samples, skipped = [], 0
    # The first and last 40 losses, in a tensor allocated up front: appending Python floats would
    # itself add blocks to the Python-allocator measure right before the last sample.
    losses = torch.zeros(80)
    sampling = 0.0
    start = time.perf_counter()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = pool[step % len(pool)]
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if bound.before_step(opt):
            opt.step()
            bound.after_step(opt)
        else:
            skipped += 1
        if step < 40:
            losses[step] = loss.detach()
        elif step >= steps - 40:
            losses[40 + step - (steps - 40)] = loss.detach()
        done = step + 1
        if done == warmup or (done > warmup and (done - warmup) % every == 0) or done == steps:
            t = time.perf_counter()
            center = getattr(bound, "center", None)
            remote = getattr(center, "remote_accumulates", 0)  # MPICH leaks 128 B on each (window.py)
            samples.append({"step": done, "remote_accumulates": remote, **sample(bound, transport)})
            sampling += time.perf_counter() - t
    seconds = time.perf_counter() - start - sampling
    bound.on_train_end()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    bound.close()
    settle_threads(baseline["os_threads"])
    after_close = sample(bound, transport)  # the closed rule is still referenced: what it holds must be freed
    del bound, opt, model, params
    gathered = COMM.allgather(flat)
    return {
        "seconds": seconds,
        "steps": steps,
        "skipped": skipped,
        "baseline": baseline,
        "samples": samples,
        "after_close": after_close,
        "loss_first": float(losses[:40].mean()),
        "loss_last": float(losses[40:].mean()),
        "finite": bool(torch.isfinite(flat).all()),
        "max_rank_diff": float(max((g - gathered[0]).abs().max() for g in gathered)),
    }


# -- Trainer-level runs ------------------------------------------------------------------------------
def run_trainer(strategy: str, steps: int) -> dict[str, object]:
    """``Trainer.fit`` for ``steps`` steps; samples before fit, before the rule is bound (callback
    ``setup``), at four points of training, and after fit."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_mpi  # noqa: F401  (registers the names)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_model()

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.02)

    class Sampler(pl.Callback):
        def __init__(self) -> None:
            self.samples: list[dict[str, object]] = []
            self.before_bind: dict[str, object] = {}

        def setup(self, trainer, pl_module, stage) -> None:  # runs before strategy.setup binds the rule
            self.before_bind = sample(trainer.strategy)

        def on_train_batch_end(self, trainer, *args) -> None:
            step = trainer.global_step
            if step in marks:
                center = getattr(trainer.strategy.bound_rule, "center", None)
                remote = getattr(center, "remote_accumulates", 0)
                self.samples.append({"step": step, "remote_accumulates": remote, **sample(trainer.strategy)})

    marks = {steps // 4, steps // 2, 3 * steps // 4, steps}
    x = torch.randn(64 * W, 8, generator=torch.Generator().manual_seed(3))
    data = TensorDataset(x, x[:, :4] + 0.3 * torch.randn(64 * W, 4, generator=torch.Generator().manual_seed(4)))
    baseline = sample()
    sampler = Sampler()
    trainer = pl.Trainer(strategy=strategy, max_steps=steps, callbacks=[sampler], **QUIET)
    start = time.perf_counter()
    trainer.fit(Module(), DataLoader(data, batch_size=4, shuffle=True))
    seconds = time.perf_counter() - start
    settle_threads(baseline["os_threads"])
    return {"seconds": seconds, "steps": trainer.global_step, "baseline": baseline,
            "before_bind": sampler.before_bind, "samples": sampler.samples, "after_fit": sample(trainer.strategy)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--every", type=int, default=1500)
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--trainer-steps", type=int, default=0)
    parser.add_argument("--trainer-strategies", default="mpi_asa16,mpi_downpour")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _collect_predefined()
    if args.trainer_steps:
        import pytorch_lightning  # noqa: F401  (imported before the freeze, like everything else)
    gc.collect()
    gc.freeze()  # start-up objects leave the collector: each sample's gc.collect() stays cheap
    transport = Transport(COMM.Dup(), timeout=60.0)
    results: dict[str, object] = {"world_size": W, "rules": {}, "trainer": {}}
    for name in filter(None, args.rules.split(",")):
        results["rules"][name] = run_rule(name, transport, args.steps, args.warmup, args.every)
    if args.trainer_steps:
        for strategy in args.trainer_strategies.split(","):
            results["trainer"][strategy] = run_trainer(strategy, args.trainer_steps)
    results["max_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    everyone = COMM.gather(results)
    if RANK == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": everyone}, f)


if __name__ == "__main__":
    main()
