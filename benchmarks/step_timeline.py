#!/usr/bin/env python3
"""Where one training step's time goes: a timeline of ``Trainer.fit`` steps, strategy by strategy.

Same model, data and settings as ``benchmarks/throughput.py`` (the 17.8M-parameter MLP, batch 8
per rank). For each strategy it records, on rank 0 and relative to the start of each step, when
backward starts and ends, when each gradient bucket's exchange is launched and when it has
arrived, when the optimizer step starts, and when the step ends; it prints the median of each
over the steps after warm-up, side by side. For ``ddp`` the buckets are timed through a DDP comm
hook that does what DDP's default hook does (``all_reduce`` of the bucket, divided by the world
size); for lightning_mpi's synchronous strategies, by wrapping ``BucketExchanger.start``.

    python benchmarks/step_timeline.py                                    # hosts:2:1gbit
    python benchmarks/step_timeline.py --settings shm:2 --strategies ddp mpi_allreduce mpi_asa16

The link is busy from the first launch to the last arrival; what lies before (forward, the last
layers' backward) and after (unpacking, the optimizer step) is what overlap cannot hide. Tables
print to stdout and go to ``benchmarks/results/step_timeline.md``; a PNG per setting shows the
bucket spans.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.throughput import RESULTS, ddp_kwargs, fit_net, parse_args, run  # noqa: E402

STEP_EVENTS = ["backward_start", "first_launch", "backward_end", "last_arrival", "optimizer_start", "step_end"]


def worker(strategy: str, steps: int, batch: int, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI

    from lightning_mpi.rules import sync

    torch.set_num_threads(1)
    events: dict[str, float] = {}

    def mark(key: str, first_only: bool = True) -> None:
        if not (first_only and key in events):
            events[key] = time.perf_counter() - events["t0"]

    def bucket_launched(index: int) -> None:
        mark("first_launch")
        mark(f"launch{index}")

    def bucket_arrived(index: int) -> None:
        mark(f"arrive{index}")
        mark("last_arrival", first_only=False)

    if strategy == "ddp":
        kwargs = ddp_kwargs()
    else:
        kwargs = {"strategy": strategy}
        start = sync.BucketExchanger.start

        def timed_start(self, bucket, on_done=None):
            bucket_launched(bucket.index)

            def arrived(b):
                bucket_arrived(b.index)
                on_done(b)

            return start(self, bucket, arrived if on_done is not None else None)

        sync.BucketExchanger.start = timed_start

    class Timeline(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def on_train_start(self, trainer, module) -> None:
            if strategy != "ddp":
                return
            import torch.distributed as dist

            def hook(_state, bucket):
                index = bucket.index()
                bucket_launched(index)
                future = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()

                def arrived(f):
                    bucket_arrived(index)
                    return f.value()[0]

                return future.then(arrived)

            trainer.strategy.model.register_comm_hook(None, hook)

        def on_train_batch_start(self, *args) -> None:
            events.clear()
            events["t0"] = time.perf_counter()

        def on_before_backward(self, *args) -> None:
            mark("backward_start")

        def on_after_backward(self, *args) -> None:
            mark("backward_end")

        def on_before_optimizer_step(self, *args) -> None:
            mark("optimizer_start")

        def on_train_batch_end(self, *args) -> None:
            mark("step_end")
            self.steps.append({k: v for k, v in events.items() if k != "t0"})

    timeline = Timeline()
    fit_net(kwargs, timeline, steps, batch)
    world = MPI.COMM_WORLD.Get_size()
    if MPI.COMM_WORLD.Get_rank() == 0:
        kept = timeline.steps[max(2, steps // 5):]
        keys = {k for step in kept for k in step}
        medians = {k: statistics.median(step[k] for step in kept if k in step) for k in keys}
        Path(out).write_text(json.dumps({"events": medians, "world": world, "batch": batch, "step": medians["step_end"]}))


def table(setting: str, results: dict[str, dict[str, float]]) -> list[str]:
    names = list(results)
    lines = [f"\n{setting}: median ms from the start of a step (rank 0)",
             "| event | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    buckets = max(sum(1 for k in r if k.startswith("launch")) for r in results.values())
    rows = STEP_EVENTS[:2] + [f"{kind}{i}" for i in range(buckets) for kind in ("launch", "arrive")] + STEP_EVENTS[2:]
    for key in rows:
        cells = [f"{1000 * results[n][key]:.1f}" if key in results[n] else "-" for n in names]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    link = [f"{1000 * (r['last_arrival'] - r['first_launch']):.0f}" if "last_arrival" in r else "-" for r in results.values()]
    lines.append("| link busy (first launch to last arrival) | " + " | ".join(link) + " |")
    tail = [f"{1000 * (r['step_end'] - r['last_arrival']):.1f}" if "last_arrival" in r else "-" for r in results.values()]
    lines.append("| after the last arrival | " + " | ".join(tail) + " |")
    return lines


def plot(setting: str, results: dict[str, dict[str, float]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 1 + 0.8 * len(results)))
    for row, (name, r) in enumerate(results.items()):
        ax.barh(row, r["step_end"] * 1000, color="lightgrey", height=0.8)
        if "backward_start" in r and "backward_end" in r:
            ax.barh(row, 1000 * (r["backward_end"] - r["backward_start"]), left=1000 * r["backward_start"], color="tab:orange", height=0.8)
        i = 0
        while f"launch{i}" in r and f"arrive{i}" in r:
            ax.barh(row - 0.3 + 0.6 * i / max(1, i + 1), 1000 * (r[f"arrive{i}"] - r[f"launch{i}"]), left=1000 * r[f"launch{i}"], height=0.15, color="tab:blue")
            i += 1
    ax.set_yticks(range(len(results)), list(results))
    ax.set_xlabel("ms from step start (grey: step, orange: backward, blue: buckets launch to arrival)")
    ax.set_title(setting)
    fig.tight_layout()
    fig.savefig(RESULTS / f"step_timeline_{setting.replace(':', '_')}.png", dpi=120)


def main() -> int:
    args = parse_args(__doc__, ["ddp", "mpi_allreduce", "mpi_asa16"], steps=30)
    if args.worker:
        worker(args.worker, args.steps, args.batch, args.out)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = [f"# step timeline ({time.strftime('%Y-%m-%d %H:%M')}): MLP, per-rank batch {args.batch}, {args.steps} steps"]
    for setting in args.settings:
        results = {name: run(setting, name, args.steps, args.batch, args.timeout, script=__file__)["events"] for name in args.strategies}
        lines += table(setting, results)
        plot(setting, results)
    print("\n".join(lines))
    (RESULTS / "step_timeline.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
