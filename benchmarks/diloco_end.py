#!/usr/bin/env python3
"""What the end of a DiLoCo run leaves, by the step at which the run stops: an outer step or the replicas' mean.

The time-to-quality task (``benchmarks/ttq_task.py``: a byte-level MLP of about 17M parameters,
fused AdamW at 3e-4, batch 16 per rank) on 2 ranks over shared memory, ``--arm`` at its defaults
(period 50, 4 fragments for Streaming DiLoCo, int4 wire), trained for ``--steps`` steps (not a
wall-clock budget: quality per step does not depend on the machine's load). After every step from
``--from`` on, every rank's weights are averaged and rank 0 evaluates on the held-out set what the
run would end with if it stopped there:

- ``outer step``: the end as it was before 2026-11-26 (issue 25): an exchange in flight and the
  steps since each fragment's last exchange folded in by the outer optimizer's step (Nesterov,
  on a copy of the outer optimizer and its momentum);
- ``replicas' mean``: the end now, θ_global ← θ_global − Δ: the mean of the ranks' weights;
- ``θ_global`` before the end, and rank 0's own weights (the time-to-quality curve's points).

The means are exact (fp32) here; the run itself sends Δ in int4 (the real end at ``--steps`` is
printed too). Training is the same in both: the end changes nothing before it.

    python benchmarks/diloco_end.py                                  # mpi_streaming_diloco, steps 100-160, ~5 min
    python benchmarks/diloco_end.py --arm mpi_diloco --from 90 --steps 130

Prints the summary and saves ``benchmarks/results/diloco_end.json`` (one row per step).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def worker(arm: str, first: int, steps: int, batch: int, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI

    import lightning_mpi
    from benchmarks.ttq_task import TaskConfig, held_out_batch, held_out_loss, load_texts, make_module, train_dataset
    from lightning_mpi.rules.diloco.outer import averages_at, last_start, outer_step_

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    cfg = TaskConfig()
    train_text, held_text, _ = load_texts(cfg, Path(tempfile.gettempdir()) / "lightning_mpi_ttq_cache")
    held = held_out_batch(held_text, cfg)
    cls = lightning_mpi.DiLoCoStrategy if arm == "mpi_diloco" else lightning_mpi.StreamingDiLoCoStrategy
    rows = []

    def loss_of(module, flats):
        """Held-out loss with the parameters set from the fragments' flat tensors (contiguous, in order)."""
        flat = torch.cat(flats)
        saved = [p.detach().clone() for p in module.parameters()]
        with torch.no_grad():
            offset = 0
            for p in module.parameters():
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            loss = held_out_loss(module.net, held)
            for p, w in zip(module.parameters(), saved, strict=True):
                p.copy_(w)
        return loss

    class Ends(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            step = trainer.global_step
            if step < first:
                return
            bound = trainer.strategy.bound_rule
            means = []
            for fragment in bound.fragments:  # collective: the mean of the ranks' weights, per fragment
                mean = fragment.local.pull()[:fragment.numel].clone()
                comm.Allreduce(MPI.IN_PLACE, mean.numpy(), op=MPI.SUM)
                means.append(mean.div_(world))
            if rank != 0:
                return
            outer = copy.deepcopy(bound.outer)  # the old end's outer steps move copies
            stepped, before = [], []
            for index, (fragment, mean) in enumerate(zip(bound.fragments, means, strict=True)):
                theta = outer.param_groups[0]["params"][index]
                before.append(theta.detach()[:fragment.numel].clone())
                running = fragment.status != "idle"
                offset = bound.offsets[index]
                if not running and last_start(step, offset, bound.period) == step:
                    stepped.append(before[-1])
                    continue
                delta = torch.zeros_like(theta)
                delta[:fragment.numel] = before[-1] - mean
                started = fragment.started if running else step
                count = (started - offset) // bound.period + 1 if started >= offset else 1
                if averages_at(count, bound.rule.outer_warmup):
                    stepped.append(mean)
                else:
                    outer_step_(outer, theta, delta)
                    stepped.append(theta.detach()[:fragment.numel].clone())
            rows.append({"step": step, "outer_step": loss_of(pl_module, stepped), "mean": loss_of(pl_module, means),
                         "theta_global": loss_of(pl_module, before), "rank0": held_out_loss(pl_module.net, held)})

    torch.manual_seed(cfg.seed)
    module = make_module(cfg)
    loader = torch.utils.data.DataLoader(train_dataset(train_text, cfg), batch_size=batch, shuffle=True)
    trainer = pl.Trainer(strategy=cls(log_stats=False), max_steps=steps, callbacks=[Ends()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    if rank == 0:
        Path(out).write_text(json.dumps({"arm": arm, "rows": rows, "end": held_out_loss(module.net, held)}))


def summary(result: dict) -> str:
    rows = result["rows"]
    gaps = [r["outer_step"] - r["mean"] for r in rows]
    worst = max(rows, key=lambda r: r["outer_step"] - r["mean"])
    lines = [
        f"{result['arm']}, end after steps {rows[0]['step']}-{rows[-1]['step']} ({len(rows)} ends):",
        f"  outer step at the end - replicas' mean: mean {sum(gaps) / len(gaps):+.3f}, "
        f"max {max(gaps):+.3f} (step {worst['step']}: {worst['outer_step']:.3f} against {worst['mean']:.3f}), "
        f"min {min(gaps):+.3f}; above it at {sum(g > 0 for g in gaps)} of {len(gaps)} steps",
        f"  rank 0's weights - replicas' mean: mean {sum(r['rank0'] - r['mean'] for r in rows) / len(rows):+.3f}",
        f"  the run's own end after step {rows[-1]['step']} (int4 wire): {result['end']:.3f}",
        "",
        "| step | outer step at the end | replicas' mean | θ_global | rank 0's weights |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['step']} | {r['outer_step']:.3f} | {r['mean']:.3f} | {r['theta_global']:.3f} | {r['rank0']:.3f} |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arm", default="mpi_streaming_diloco", choices=["mpi_streaming_diloco", "mpi_diloco"])
    p.add_argument("--from", dest="first", type=int, default=100, help="the first end step evaluated")
    p.add_argument("--steps", type=int, default=160, help="steps trained (the last end step evaluated)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default=str(RESULTS / "diloco_end.json"))
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_out:
        worker(args.arm, args.first, args.steps, args.batch, args.worker_out)
        return 0
    mpiexec = Path(sys.executable).with_name("mpiexec")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [str(mpiexec), "-n", "2", sys.executable, __file__, "--worker-out", str(out), "--arm", args.arm,
               "--from", str(args.first), "--steps", str(args.steps), "--batch", str(args.batch)]
        run = subprocess.run(cmd, capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
        if run.returncode != 0 or not out.exists():
            print(f"failed\n{run.stderr[-3000:]}", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    print(summary(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
