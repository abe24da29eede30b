"""Quality per step, without a clock: the time-to-quality task trained for a fixed number of steps.

``benchmarks/time_to_quality.py`` asks what each arm reaches in a wall-clock budget, which mixes
two things: how many steps an arm makes (its exchanges, the machine) and what each step is worth
(its rule). This script separates them. Every rank trains ``ARM`` (a strategy name or ``local``,
with ``name:key=value`` overrides as in ``time_to_quality.py``) for exactly ``STEPS`` steps, and
rank 0 prints one JSON line: the held-out loss of the final weights (for local-step rules the
replicas' mean, as ``fit`` leaves them), the mean step time past the first 10 steps, what rank 0's
process spent per step over the same steps (``user_ms`` and ``sys_ms`` of CPU, every thread
together, and ``page_faults``: a step that frees and maps its gradients anew pays in the kernel),
and with
``--marks`` the held-out loss of rank 0's own weights at those steps (for ``local``: one
process's curve by steps, the yardstick)::

    python benchmarks/ttq_fixed_steps.py local 500 --marks 200 250 300 350 400 450
    mpiexec -n 2 python benchmarks/ttq_fixed_steps.py mpi_streaming_diloco 200
    mpiexec -n 2 python benchmarks/ttq_fixed_steps.py mpi_streaming_diloco:wire=sparseloco 300 --seed 1

``--raw`` times the task's training step alone (no Lightning, no MPI), for what one process of
this model makes per second on this machine; run two at once to see what two ranks sharing its
cores can make at most::

    python benchmarks/ttq_fixed_steps.py --raw
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def raw_steps_per_second(seconds: float = 8.0) -> float:
    """Steps per second of the task's model and optimizer alone, one thread, random bytes."""
    import torch

    from benchmarks import ttq_task

    torch.set_num_threads(1)
    module = ttq_task.make_module(ttq_task.TaskConfig())
    optimizer = module.configure_optimizers()
    x, y = torch.randint(0, 256, (16, 64)), torch.randint(0, 256, (16,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(module.net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(5):
        step()
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        step()
        steps += 1
    return steps / (time.perf_counter() - start)


def usage_per_step(usage: list, steps: int) -> dict:
    """``user_ms``, ``sys_ms`` and ``page_faults`` per step between two ``getrusage`` readings
    ``steps`` steps apart (nothing when there are not two: a run too short to have them)."""
    if len(usage) != 2 or steps < 1:
        return {}
    first, last = usage
    return {
        "user_ms": round(1e3 * (last.ru_utime - first.ru_utime) / steps, 1),
        "sys_ms": round(1e3 * (last.ru_stime - first.ru_stime) / steps, 1),
        "page_faults": round((last.ru_minflt + last.ru_majflt - first.ru_minflt - first.ru_majflt) / steps),
    }


def fixed_steps(arm: str, steps: int, marks: list[int], data: Path, seed: int = 0) -> dict | None:
    """Train ``arm`` for ``steps`` steps on every rank; rank 0's result (None on the others).
    ``seed``: the task's (initial weights and training windows)."""
    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI

    from benchmarks import ttq_task
    from benchmarks.ttq_worker import QUIET_TRAINER, train_loader, trainer_kwargs

    torch.set_num_threads(1)
    rank = MPI.COMM_WORLD.Get_rank()
    cfg = ttq_task.TaskConfig(seed=seed)
    if rank == 0:  # one rank builds the cache of the task's bytes; the others wait and read it
        ttq_task.load_texts(cfg, data)
    MPI.COMM_WORLD.Barrier()
    train_text, held_text, _ = ttq_task.load_texts(cfg, data)
    held = ttq_task.held_out_batch(held_text, cfg)

    class Marks(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.usage: list[resource.struct_rusage] = []
            self.snapshots: dict[int, list] = {}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter())
            if len(self.times) in (11, steps):  # the steps step_ms covers
                self.usage.append(resource.getrusage(resource.RUSAGE_SELF))
            if rank == 0 and len(self.times) in marks:
                self.snapshots[len(self.times)] = [p.detach().clone() for p in module.parameters()]

    recorder = Marks()
    trainer = pl.Trainer(max_steps=steps, callbacks=[recorder], **QUIET_TRAINER, **trainer_kwargs(arm))
    module = ttq_task.make_module(cfg)
    trainer.fit(module, train_loader(train_text, cfg, 16))
    if rank != 0:
        return None
    gaps = [b - a for a, b in zip(recorder.times[10:], recorder.times[11:], strict=False)]
    result = {"arm": arm, "steps": steps, "seed": seed, "step_ms": round(1e3 * sum(gaps) / max(1, len(gaps)), 1),
              **usage_per_step(recorder.usage, steps - 11),
              "final_loss": round(ttq_task.held_out_loss(module.net, held), 4), "marks": {}}
    with torch.no_grad():
        for step, weights in sorted(recorder.snapshots.items()):
            for p, w in zip(module.parameters(), weights, strict=True):
                p.copy_(w)
            result["marks"][step] = round(ttq_task.held_out_loss(module.net, held), 4)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arm", nargs="?", help="strategy name (name:key=value,...) or local")
    parser.add_argument("steps", nargs="?", type=int, help="steps to train")
    parser.add_argument("--marks", type=int, nargs="*", default=[], help="steps at which rank 0's weights are scored")
    parser.add_argument("--seed", type=int, default=0, help="the task's seed: initial weights and training windows")
    parser.add_argument("--raw", action="store_true", help="time the task's training step alone and exit")
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "results" / "ttq_data_fixed_steps.pt",
                        help="cache of the task's bytes (built on first use)")
    args = parser.parse_args()
    if args.raw:
        print(json.dumps({"raw_steps_per_second": round(raw_steps_per_second(), 2)}))
        return 0
    if args.arm is None or args.steps is None or args.steps < 1:
        parser.error("give ARM and STEPS (a positive number of steps), or --raw")
    args.data.parent.mkdir(parents=True, exist_ok=True)
    result = fixed_steps(args.arm, args.steps, args.marks, args.data, args.seed)
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
