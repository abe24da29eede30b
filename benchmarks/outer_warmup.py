#!/usr/bin/env python3
"""DiLoCo's first outer steps in a short run: the held-out loss around each outer step, by ``outer_warmup``.

The time-to-quality task (``benchmarks/ttq_task.py``: a byte-level MLP of about 17M parameters,
fused AdamW at 3e-4, batch 16 per rank) on 2 ranks over shared memory, for a fixed number of
steps (not a wall-clock budget: the question is what an outer step does to the loss, not how fast
it comes), with ``mpi_diloco`` / ``mpi_streaming_diloco`` at their defaults (period 50, outer lr
0.7, Nesterov 0.9) and ``outer_warmup`` = 0, 1, 2, 3. Rank 0 evaluates its own weights on the
held-out set every ``--every`` steps (after an outer step they are θ_global) and after ``fit``.

    python benchmarks/outer_warmup.py                       # 150 steps, 4 warm-ups x 2 rules, ~10 min
    python benchmarks/outer_warmup.py --steps 100 --arms mpi_diloco:0 mpi_diloco:2

Prints one table (loss before and after each outer step, and at the end) and saves
``benchmarks/results/outer_warmup.json``. Quality per step does not depend on the machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
ARMS = [f"{name}:{k}" for name in ("mpi_diloco", "mpi_streaming_diloco") for k in (0, 1, 2, 3)]


def worker(arm: str, steps: int, every: int, batch: int, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI

    import lightning_mpi
    from benchmarks.ttq_task import TaskConfig, held_out_batch, held_out_loss, load_texts, make_module, train_dataset

    rank = MPI.COMM_WORLD.Get_rank()
    name, _, warmup = arm.partition(":")
    cfg = TaskConfig()
    train_text, held_text, _ = load_texts(cfg, Path(tempfile.gettempdir()) / "lightning_mpi_ttq_cache")
    held = held_out_batch(held_text, cfg)
    cls = lightning_mpi.DiLoCoStrategy if name == "mpi_diloco" else lightning_mpi.StreamingDiLoCoStrategy
    strategy = cls(outer_warmup=int(warmup or 0), log_stats=False)
    curve = []

    class Eval(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            step = trainer.global_step
            if rank == 0 and (step % every == 0 or step % 50 in (49, 0, 1)):
                curve.append((step, held_out_loss(pl_module.net, held)))

    module = make_module(cfg)
    loader = torch.utils.data.DataLoader(train_dataset(train_text, cfg), batch_size=batch, shuffle=True)
    trainer = pl.Trainer(strategy=strategy, max_steps=steps, callbacks=[Eval()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    if rank == 0:
        final = held_out_loss(module.net, held)
        Path(out).write_text(json.dumps({"arm": arm, "curve": curve, "final": final}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", default=ARMS, help="RULE:OUTER_WARMUP (default: both rules x 0..3)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default=str(RESULTS / "outer_warmup.json"))
    p.add_argument("--worker", nargs=1, metavar="ARM", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.steps, args.every, args.batch, args.worker_out)
        return 0
    mpiexec = Path(sys.executable).with_name("mpiexec")
    results = {}
    for arm in args.arms:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            cmd = [str(mpiexec), "-n", "2", sys.executable, __file__, "--worker", arm, "--worker-out", str(out),
                   "--steps", str(args.steps), "--every", str(args.every), "--batch", str(args.batch)]
            run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            if run.returncode != 0 or not out.exists():
                print(f"{arm}: failed\n{run.stderr[-2000:]}", file=sys.stderr)
                continue
            results[arm] = json.loads(out.read_text())
            print(f"{arm}: final {results[arm]['final']:.3f}", flush=True)
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "results": results}, indent=1))
    return 0


def table(results: dict) -> str:
    """Loss before and after each outer step (steps 49/50, 99/100, ...), and at the end."""
    if not results:
        return "(no results)"
    marks = sorted({s for r in results.values() for s, _ in r["curve"] if s % 50 in (0, 49) and s > 0})
    rows = ["| rule:outer_warmup | " + " | ".join(f"step {s}" for s in marks) + " | end |",
            "|---|" + "---|" * (len(marks) + 1)]
    for arm, r in results.items():
        at = dict(r["curve"])
        rows.append(f"| {arm} | " + " | ".join(f"{at[s]:.3f}" if s in at else "-" for s in marks)
                    + f" | {r['final']:.3f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
