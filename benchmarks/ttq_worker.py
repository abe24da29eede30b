"""One arm of the time-to-quality benchmark, on every rank of one ``mpiexec`` (or one process).

Usage (the driver, ``benchmarks/time_to_quality.py``, writes the JSON spec)::

    python benchmarks/ttq_worker.py SPEC.json

The spec names the arm (a strategy name, a ddp peer from ``benchmarks/ddp_peers.py``, or
``local``: one process, no exchange), its wall-clock run length, the times at which rank 0 takes a
snapshot of its weights, the per-rank batch and the task's sizes (``ttq_task.TaskConfig``).

The clock starts at the first training step (not at process start) and excludes the snapshots'
copy time. Rank 0 decides when to stop and tells the others through ``trainer.strategy.broadcast``
after every step, as Lightning's own ``Timer`` does (the asynchronous strategies answer it without
a barrier). Snapshots are evaluated on the held-out set only after training, so evaluating costs
no rank any training time. The last point is the held-out loss of the weights ``fit`` leaves
(after ``on_train_end``: for local-step and asynchronous rules, the average or the center).

Rank 0 writes a progress file as it goes (so a hung arm can be reported with how far it got) and
the arm's result JSON at the end.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import time
from pathlib import Path

PROCESS_START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: stats() keys that give the bytes one exchange put on the wire, most specific first
BYTES_KEYS = ("bytes_per_exchange", "wire_bytes", "bytes_sent", "bytes")


def parse_arm(spec: str) -> tuple[str, dict]:
    """``"name"`` or ``"name:key=value,key=value"`` (values as Python literals) -> (name, overrides)."""
    name, _, rest = spec.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"arm={spec!r}: expected name:key=value,... (got {item!r})")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value
    return name, overrides


def exchange_bytes(stats: dict) -> float | None:
    """Bytes of the last exchange in a rule's ``stats()``, or None when it reports none."""
    for key in BYTES_KEYS:
        if key in stats:
            return float(stats[key])
    found = [float(v) for k, v in stats.items() if k.endswith("_bytes") and not k.startswith("dense")]
    return max(found) if found else None


#: Trainer arguments of every arm: CPU, nothing logged, saved, shown or validated
QUIET_TRAINER = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                 "enable_model_summary": False, "num_sanity_val_steps": 0, "limit_val_batches": 0}


def train_loader(train_text, cfg, batch: int):
    """The training windows, shuffled, in batches of ``batch`` (the Trainer shards them over ranks)."""
    import torch

    from benchmarks import ttq_task

    return torch.utils.data.DataLoader(ttq_task.train_dataset(train_text, cfg), batch_size=batch, shuffle=True,
                                       drop_last=True)


def trainer_kwargs(arm: str) -> dict:
    """Strategy (and layout) Trainer arguments for ``arm``."""
    from benchmarks import ddp_peers

    name, overrides = parse_arm(arm)
    if name == "local":
        return {"strategy": "auto", "devices": 1}
    if ddp_peers.is_ddp_peer(name):
        return ddp_peers.trainer_kwargs(name, **overrides)
    import lightning_mpi  # noqa: F401  (registers the names)
    from pytorch_lightning.strategies import StrategyRegistry

    if not overrides:
        return {"strategy": name}
    entry = StrategyRegistry[name]
    return {"strategy": entry["strategy"](**{**entry["init_params"], **overrides})}


def weights_digest(module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def make_clock(spec: dict, rank: int):
    """The callback that keeps the budget clock, counts steps, snapshots weights and stops."""
    import pytorch_lightning as pl

    progress = Path(spec["progress"])

    class BudgetClock(pl.Callback):
        def __init__(self) -> None:
            self.t0 = None
            self.paused = 0.0
            self.steps = self.samples = 0
            self.marks = sorted(spec["marks"])
            self.snapshots: list[tuple[float, int, int, list]] = []
            self.peak_bytes: float | None = None
            self.last_stats: dict = {}
            self.elapsed = 0.0
            self.first_step_at = None

        def now(self) -> float:
            return time.perf_counter() - self.t0 - self.paused

        def report(self, phase: str) -> None:
            if rank == 0:
                progress.write_text(json.dumps({"phase": phase, "steps": self.steps, "t": round(self.elapsed, 2)}))

        def snapshot(self, module) -> None:
            start = time.perf_counter()
            weights = [p.detach().clone() for p in module.parameters()]
            self.snapshots.append((self.elapsed, self.steps, self.samples, weights))
            self.report("training")
            self.paused += time.perf_counter() - start

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if self.t0 is None:
                self.t0 = time.perf_counter()
                self.first_step_at = self.t0 - PROCESS_START
                if rank == 0:
                    self.snapshot(module)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.steps += 1
            self.samples += len(batch[0])
            self.elapsed = self.now()
            bound = getattr(trainer.strategy, "bound_rule", None)
            if bound is not None and rank == 0:
                self.last_stats = dict(bound.stats())
                sent = exchange_bytes(self.last_stats)
                if sent:
                    self.peak_bytes = max(self.peak_bytes or 0.0, sent)
            if rank == 0 and self.marks and self.elapsed >= self.marks[0]:
                self.snapshot(module)
                self.marks = [m for m in self.marks if m > self.elapsed]
            stop = trainer.strategy.broadcast(bool(self.elapsed >= spec["run_seconds"]) if rank == 0 else False)
            trainer.should_stop = trainer.should_stop or bool(stop)

    return BudgetClock()


def run(spec: dict) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI

    from benchmarks import ttq_task

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    stacks = None
    if spec.get("dump_stacks_after"):  # a hung arm leaves every rank's stacks for the driver's report
        import faulthandler

        stacks = open(Path(spec["progress"]).with_name(f"stacks.{rank}"), "w")  # noqa: SIM115  (kept open)
        faulthandler.dump_traceback_later(max(1.0, spec["dump_stacks_after"] - (time.perf_counter() - PROCESS_START)),
                                          file=stacks)
    cfg = ttq_task.TaskConfig(**spec["task"])
    train_text, held_text, digest = ttq_task.load_texts(cfg, Path(spec["data"]))
    module = ttq_task.make_module(cfg)
    clock = make_clock(spec, rank)
    clock.report("starting")
    trainer = pl.Trainer(max_epochs=10_000, callbacks=[clock], **QUIET_TRAINER, **trainer_kwargs(spec["arm"]))
    trainer.fit(module, train_loader(train_text, cfg, spec["batch"]))
    if stacks is not None:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
    clock.report("evaluating")
    per_rank = comm.gather((clock.steps, clock.samples, weights_digest(module)), root=0)
    if rank == 0:
        torch.set_num_threads(len(os.sched_getaffinity(0)))  # the other ranks only wait now
        eval_start = time.perf_counter()
        result = evaluate(module, clock, ttq_task.held_out_batch(held_text, cfg), world)
        result["eval_seconds"] = time.perf_counter() - eval_start
        result.update(
            arm=spec["arm"], world=world, batch=spec["batch"], run_seconds=spec["run_seconds"], data_digest=digest,
            params=sum(p.numel() for p in module.parameters()), python=sys.version.split()[0],
            steps_per_rank=[s for s, _, _ in per_rank], samples=sum(n for _, n, _ in per_rank),
            same_weights=len({d for _, _, d in per_rank}) == 1, peak_exchange_bytes=clock.peak_bytes,
            rule_stats=clock.last_stats, startup_seconds=clock.first_step_at,
        )
        Path(spec["out"]).write_text(json.dumps(result))
        clock.report("done")
    _wait_politely(comm)


def evaluate(module, clock, held, world: int) -> dict:
    """Held-out loss of the final weights and of every snapshot (restoring the final weights after)."""
    import torch

    from benchmarks import ttq_task

    final_loss = ttq_task.held_out_loss(module.net, held)
    final = [p.detach().clone() for p in module.parameters()]
    curve = []
    for t, steps, samples, weights in clock.snapshots:
        with torch.no_grad():
            for p, w in zip(module.parameters(), weights):
                p.copy_(w)
        curve.append({"t": t, "steps": steps, "samples": samples * world, "loss": ttq_task.held_out_loss(module.net, held)})
    with torch.no_grad():
        for p, w in zip(module.parameters(), final):
            p.copy_(w)
    clock.snapshots.clear()
    return {"curve": curve, "final_loss": final_loss, "seconds": clock.elapsed, "steps": clock.steps}


def _wait_politely(comm) -> None:
    """Barrier that sleeps between tests: MPICH's blocking waits spin, and the ranks that are done
    must not take the cores rank 0 evaluates on."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.05)


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    run(spec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
