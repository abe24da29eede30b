#!/usr/bin/env python3
"""Top-k accuracy: ``mpi_topk`` (and variants) against ``mpi_asa`` on digits, over seeds.

    python benchmarks/topk_accuracy.py                       # mpi_asa, mpi_topk, the variants; seeds 0 1 2
    python benchmarks/topk_accuracy.py --arms mpi_asa mpi_topk "mpi_topk@momentum_correction=false"
    python benchmarks/topk_accuracy.py --seeds 0 1 2 3 4 --epochs 8

The held-out check of issue 25: the digits example's task (``examples/digits.py``: scikit-learn's
1,797 8x8 digits, split 80/20 with a fixed seed, its CNN trained by SGD with momentum 0.9 at
lr 0.05, batch 32 per rank), 8 epochs on 2 ranks. One ``mpiexec -n 2`` per seed trains every arm
in turn from ``seed_everything(seed)`` (the same initial weights and the same data order for every
arm of a seed); accuracy is that of the final weights on the whole validation split (360 images),
computed on rank 0 after ``fit``. Seeds run one after the other, each rank on one thread
(``OMP_NUM_THREADS=1``): accuracy is not timed, so no lock is needed.

An arm is a registered name, optionally with overrides: ``NAME@key=value+key=value`` (values are
parsed as Python literals: ``true``/``false``/``none`` work too).

Prints per-seed accuracies, their mean, the difference to ``mpi_asa`` per seed and its mean, and
the spread (max - min over seeds); writes ``benchmarks/results/topk_accuracy.json`` and ``.png``.
Not a test.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"

#: The default arms: the peer; mpi_topk at its defaults ("delta16" entries + error feedback + 40
#: steps of warm-up); the int32/float32 pairs of before (with and without warm-up); the bound of
#: twice the pairs (twice the bytes); and DGC's other pieces switched on in turn.
ARMS = [
    "mpi_asa",
    "mpi_topk",
    "mpi_topk@topk_packing='pairs'",  # before: pairs + warm-up
    "mpi_topk@topk_packing='pairs'+ratio_warmup_steps=0",  # before issue 25
    "mpi_topk@ratio_warmup_steps=0",  # delta16 without warm-up
    "mpi_topk@topk_packing='pairs'+ratio=0.02",  # twice the entries in twice the bytes
    "mpi_topk@momentum_correction=true+momentum_masking=false",
    "mpi_topk@topk_packing='pairs'+layerwise=true",
    "mpi_topk@clip_norm=1.0",
]


def parse_arm(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition("@")
    kwargs = {}
    for item in filter(None, rest.split("+")):
        key, _, value = item.partition("=")
        word = {"true": "True", "false": "False", "none": "None"}.get(value.lower(), value)
        kwargs[key] = ast.literal_eval(word)
    return name, kwargs


# ------------------------------------------------------------------------------------- worker ---
def worker(seed: int, epochs: int, arms: list[str], out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI

    import lightning_mpi
    from lightning_mpi import STRATEGIES

    sys.path.insert(0, str(REPO / "examples"))
    from digits import DigitsCNN, DigitsData

    torch.set_num_threads(1)
    rank = MPI.COMM_WORLD.Get_rank()
    results = {}
    for spec in arms:
        name, overrides = parse_arm(spec)
        class_name, params, _ = STRATEGIES[name]
        strategy = getattr(lightning_mpi, class_name)(**{**params, **overrides})
        pl.seed_everything(seed, verbose=False)
        model, data = DigitsCNN(), DigitsData()
        trainer = pl.Trainer(
            strategy=strategy,
            max_epochs=epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        begin = time.perf_counter()
        trainer.fit(model, data)
        seconds = time.perf_counter() - begin
        if rank == 0:
            data.setup("validate")
            x, y = data.val_set.tensors
            model.eval()
            with torch.no_grad():
                accuracy = float((model.net(x).argmax(1) == y).float().mean())
            results[spec] = {"accuracy": accuracy, "seconds": seconds, "steps": trainer.global_step}
            print(f"seed {seed} {spec}: {accuracy:.4f} ({seconds:.1f} s)", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


# ----------------------------------------------------------------------------------- launcher ---
def run_seed(seed: int, epochs: int, arms: list[str], ranks: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out.json"
        path = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        cmd = [
            "mpiexec",
            "-n",
            str(ranks),
            sys.executable,
            __file__,
            "--worker",
            "--seed",
            str(seed),
            "--epochs",
            str(epochs),
            "--out",
            str(out),
            "--arms",
            *arms,
        ]
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
        return json.loads(out.read_text())


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def summarize(per_seed: dict[int, dict], arms: list[str], baseline: str) -> dict:
    seeds = sorted(per_seed)
    summary = {}
    for arm in arms:
        acc = [100 * per_seed[s][arm]["accuracy"] for s in seeds]
        entry = {"accuracy": acc, "mean": statistics.mean(acc), "spread": max(acc) - min(acc)}
        if baseline in arms:
            diff = [a - 100 * per_seed[s][baseline]["accuracy"] for a, s in zip(acc, seeds, strict=True)]
            entry.update(diff=diff, mean_diff=statistics.mean(diff))
        summary[arm] = entry
    return summary


def report(summary: dict, seeds: list[int]) -> str:
    header = ["arm", *(f"seed {s} %" for s in seeds), "mean %", "spread", *(f"diff {s}" for s in seeds), "mean diff"]
    rows = []
    for arm, e in summary.items():
        diffs = [f"{d:+.2f}" for d in e.get("diff", [])] or [""] * len(seeds)
        mean_diff = f"{e['mean_diff']:+.2f}" if "mean_diff" in e else ""
        accs = [f"{a:.2f}" for a in e["accuracy"]]
        rows.append([arm, *accs, f"{e['mean']:.2f}", f"{e['spread']:.2f}", *diffs, mean_diff])
    return table(header, rows)


def plot(summary: dict, seeds: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(arms) + 2))
    for i, arm in enumerate(arms):
        e = summary[arm]
        ax.scatter(e["accuracy"], [i] * len(seeds), color="tab:blue", s=18, zorder=3)
        ax.scatter([e["mean"]], [i], color="tab:red", marker="|", s=300, zorder=4)
    if "mpi_asa" in summary:
        ax.axvline(summary["mpi_asa"]["mean"], color="gray", lw=0.8, ls="--")
        ax.axvline(summary["mpi_asa"]["mean"] - 0.5, color="gray", lw=0.8, ls=":")
    ax.set_yticks(range(len(arms)), [a.replace("mpi_topk@", "topk @ ").replace("+", " + ") for a in arms], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("validation accuracy % (dots: seeds; bar: mean; dashed: mpi_asa's mean; dotted: 0.5 below)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=ARMS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--name", default="topk_accuracy", help="results file stem under benchmarks/results")
    ap.add_argument("--replot", metavar="JSON", help="print the table and redraw the plot of a saved run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.seed, args.epochs, args.arms, args.out)
        return
    if args.replot:
        record = json.loads(Path(args.replot).read_text())
        print(report(record["summary"], record["seeds"]))
        plot(record["summary"], record["seeds"], Path(args.replot).with_suffix(".png"), record["task"])
        return
    per_seed = {}
    for seed in args.seeds:
        per_seed[seed] = run_seed(seed, args.epochs, args.arms, args.ranks)
    summary = summarize(per_seed, args.arms, "mpi_asa")
    title = f"digits CNN, {args.ranks} ranks, {args.epochs} epochs, SGD momentum 0.9: top-k against mpi_asa"
    print(f"\n{title}\n")
    print(report(summary, args.seeds))
    RESULTS.mkdir(exist_ok=True)
    record = {
        "task": title,
        "seeds": args.seeds,
        "epochs": args.epochs,
        "ranks": args.ranks,
        "per_seed": {str(s): v for s, v in per_seed.items()},
        "summary": summary,
    }
    (RESULTS / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    plot(summary, args.seeds, RESULTS / f"{args.name}.png", title)
    print(f"\nwrote {RESULTS / args.name}.json and .png")


if __name__ == "__main__":
    main()
