"""What the buddy copy costs that lets ZeRO heal (``heal="shrink"``; ``lightning_mpi/rules/zero/mirror.py``).

    OMP_NUM_THREADS=1 flock /tmp/bench.lock python benchmarks/zero_mirror.py --worlds 2 4

Arms (``benchmarks/zero_worker.py``, the rule driven directly as the strategies drive it, Adam, an
MLP of ``--depth`` square layers ``--width`` wide, ``--batch`` rows per rank), ``--repeats`` rounds with
the arms in turn, one ``mpiexec`` job each:

- ``zero``: ``ZeroRule`` as without ``heal`` (the reduce-scatter overlapped with backward);
- ``zero_mirror``: as under ``heal``: every rank also keeps and steps the copy of its buddy's shard,
  receives the buddy's averaged gradient chunk (1/W of the gradient bytes, point to point), and
  the reduce-scatter starts after backward (a redo after a heal puts the gradients back);
- ``asa``: ``SyncRule(exchange="asa")`` with the full Adam on every rank, the peer that heals with
  no copy at all (every rank holds the whole optimizer state).

Reported: the median step time, samples/s, the optimizer state per rank (the mirror's included),
and peak RSS per rank. A table goes to stdout; ``benchmarks/results/zero_mirror.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from zero import RESULTS, run_arm  # noqa: E402

ARMS = {
    "zero": "ZeroRule + sharded Adam (heal=None)",
    "zero_mirror": "ZeroRule + sharded Adam + buddy copy (heal='shrink')",
    "asa": "SyncRule(asa) + full Adam",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for round_ in range(args.repeats):
            for arm in list(ARMS) if round_ % 2 == 0 else list(reversed(ARMS)):
                result = run_arm(arm, world, args.width, args.depth, args.batch, args.steps)
                if "error" in result:
                    raise SystemExit(f"{arm} at W={world}: {result['error']}")
                runs[arm].append(result)
        for arm, results in runs.items():
            rows.append({
                "arm": arm,
                "what": ARMS[arm],
                "world_size": world,
                "params": results[0]["params"],
                "step_seconds": statistics.median(r["step_seconds"] for r in results),
                "samples_per_second": statistics.median(r["samples_per_second"] for r in results),
                "optimizer_state_mib": max(results[0]["optimizer_state_mib"]),
                "peak_rss_mib": max(max(r["peak_rss_mib"]) for r in results),
            })
    print(f"{'W':>2}  {'arm':<12} {'step ms':>8} {'samples/s':>10} {'opt state MiB/rank':>19} {'peak RSS MiB':>13}")
    for row in rows:
        print(f"{row['world_size']:>2}  {row['arm']:<12} {row['step_seconds'] * 1e3:8.1f} "
              f"{row['samples_per_second']:10.1f} {row['optimizer_state_mib']:19.1f} {row['peak_rss_mib']:13.0f}")
    RESULTS.mkdir(exist_ok=True)
    load = os.getloadavg()
    out = {"args": vars(args), "load_before_last_run": load, "rows": rows}
    (RESULTS / "zero_mirror.json").write_text(json.dumps(out, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, key, label in ((axes[0], "step_seconds", "step time (s)"),
                               (axes[1], "optimizer_state_mib", "optimizer state per rank (MiB)")):
            for i, arm in enumerate(ARMS):
                xs = [w + (i - 1) * 0.25 for w in args.worlds]
                ys = [next(r[key] for r in rows if r["arm"] == arm and r["world_size"] == w) for w in args.worlds]
                ax.bar(xs, ys, width=0.25, label=arm)
            ax.set_xticks(args.worlds)
            ax.set_xlabel("ranks")
            ax.set_ylabel(label)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / "zero_mirror.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
