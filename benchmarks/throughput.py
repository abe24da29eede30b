#!/usr/bin/env python3
"""Samples/s through ``Trainer.fit`` for each synchronous strategy against Lightning's ``ddp`` (gloo)
and ``ddp`` with torch's communication hooks (``ddp_fp16``, ``ddp_powersgd1``, ``ddp_powersgd4``;
see ``benchmarks/ddp_peers.py``).

The model is an MLP of about 17.8M parameters (71 MB of fp32 gradients) with a small per-rank
batch, so that the exchange matters. For each setting and strategy it reports samples/s, the
speed-up over ``ddp``, the step time, the part of it spent waiting on the exchange, and the
overlap check: step time against compute alone plus exchange alone. Compute alone is measured in
the same setting, with the same ranks sharing the same cores, by a strategy that exchanges nothing
(simulated hosts share this machine's cores, so one rank alone would compute faster than it does
beside the others); exchange alone is the exchange's time with ``overlap=False``.

    python benchmarks/throughput.py                                     # hosts:2:1gbit
    python benchmarks/throughput.py --settings shm:2 shm:4 hosts:2:1gbit hosts:4:1gbit

Several settings add a scaling table: samples/s and the speed-up over one rank.

Tables print to stdout and go to ``benchmarks/results/throughput_b<batch>.md``; a PNG plot of
samples/s per setting is saved beside it. A larger ``--batch`` gives backward more time to hide
the exchange behind (the overlap check).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ddp_peers import is_ddp_peer  # noqa: E402
RESULTS = ROOT / "benchmarks" / "results"
STRATEGIES = ["ddp", "ddp_fp16", "ddp_powersgd1", "ddp_powersgd4", "mpi_allreduce", "mpi_asa", "mpi_asa16", "mpi_asa_bf16"]


def build_net():
    """The benchmark model: an MLP of 17,856,522 parameters, SGD (lr 1e-3)."""
    import pytorch_lightning as pl
    import torch
    from torch import nn

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            w = 2048
            self.net = nn.Sequential(nn.Linear(512, w), nn.ReLU(), *[m for _ in range(4) for m in (nn.Linear(w, w), nn.ReLU())], nn.Linear(w, 10))

        def training_step(self, b, i):
            return nn.functional.cross_entropy(self.net(b[0]), b[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Net()


def fit_net(trainer_kwargs: dict, callback, steps: int, batch: int):
    """``Trainer.fit`` of :func:`build_net` on ``steps`` random batches of ``batch`` per rank, with
    ``callback`` timing it; returns the trainer."""
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI
    from torch.utils.data import DataLoader, TensorDataset

    n = batch * MPI.COMM_WORLD.Get_size() * steps
    data = TensorDataset(torch.randn(n, 512), torch.randint(0, 10, (n,)))
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **trainer_kwargs)
    trainer.fit(build_net(), DataLoader(data, batch_size=batch))
    return trainer


def ddp_kwargs(name: str = "ddp") -> dict:
    """Trainer arguments for Lightning's ddp (or a comm-hook peer) under mpiexec: it needs the
    layout by hand."""
    from benchmarks import ddp_peers

    return ddp_peers.trainer_kwargs(name)


def worker(strategy: str, steps: int, batch: int, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI

    import lightning_mpi

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD.Get_size()

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.exchange: list[float] = []

        def on_train_batch_start(self, *a) -> None:
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, *a) -> None:
            self.times.append(time.perf_counter() - self.t)
            bound = getattr(trainer.strategy, "bound_rule", None)
            if bound is not None:
                self.exchange.append(bound.stats().get("exchange_seconds", 0.0))

    if is_ddp_peer(strategy):
        kwargs = ddp_kwargs(strategy)
    elif strategy == "compute":
        from lightning_mpi.rules.base import BoundRule, Rule

        class NoExchange(Rule):
            name = "none"

            def bind(self, transport, params):
                return BoundRule(transport, params)

        kwargs = {"strategy": lightning_mpi.MPIStrategy(rule=NoExchange())}
    elif strategy.endswith(":nooverlap"):
        name = strategy.split(":")[0]
        exchange = "allreduce" if name == "mpi_allreduce" else "asa"
        wire = {"mpi_asa16": "fp16", "mpi_asa_bf16": "bf16"}.get(name, "fp32")
        kwargs = {"strategy": lightning_mpi.SyncStrategy(exchange=exchange, wire=wire, overlap=False)}
    else:  # a registered name, or name:key=value,... (e.g. mpi_powersgd:rank=4)
        from benchmarks.ttq_worker import trainer_kwargs

        kwargs = trainer_kwargs(strategy)
    clock = Clock()
    trainer = fit_net(kwargs, clock, steps, batch)
    warm = max(2, steps // 5)
    step = statistics.median(clock.times[warm:])
    exch = statistics.median(clock.exchange[warm:]) if clock.exchange else 0.0
    if MPI.COMM_WORLD.Get_rank() == 0:
        params = sum(p.numel() for p in trainer.lightning_module.parameters())
        Path(out).write_text(json.dumps({"step": step, "exchange": exch, "world": world, "batch": batch, "params": params}))


def run(setting: str, strategy: str, steps: int, batch: int, timeout: float, script: str = __file__) -> dict:
    """Run ``script --worker strategy`` in ``setting`` (``shm:N`` or ``hosts:N:RATE``); its JSON result."""
    out = RESULTS / f"{Path(script).stem}_b{batch}_{setting.replace(':', '_')}_{strategy.replace(':', '_')}.json"
    args = [sys.executable, script, "--worker", strategy, "--out", str(out), "--steps", str(steps), "--batch", str(batch)]
    kind, *rest = setting.split(":")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    if kind == "shm":
        env["GLOO_SOCKET_IFNAME"] = "lo"
        from lightning_mpi.launcher.checks import find_mpiexec

        subprocess.run([find_mpiexec(), "-n", rest[0], *args], env=env, check=True, timeout=timeout, capture_output=True)
    else:
        sys.path.insert(0, str(ROOT))
        from benchmarks.cluster import SimCluster

        with SimCluster(int(rest[0]), rate=rest[1]) as cluster:
            res = cluster.run_mpi(args, env={"GLOO_SOCKET_IFNAME": cluster.iface, "PYTHONPATH": str(ROOT)}, timeout=timeout)
            if res.returncode:
                raise SystemExit(f"{setting} {strategy} failed:\n{res.stderr[-3000:]}")
    return json.loads(out.read_text())


def scaling_table(plot_data: dict[str, dict[str, float]], single: float) -> list[str]:
    """Samples/s per strategy across settings, and the speed-up over one rank (compute alone)."""
    if len(plot_data) < 2:
        return []
    settings = list(plot_data)
    strategies = list(dict.fromkeys(s for values in plot_data.values() for s in values))
    lines = [f"\nscaling: samples/s (speed-up over one rank at {single:.1f} samples/s)",
             "| strategy | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for strategy in strategies:
        cells = [f"{plot_data[s][strategy]:.1f} ({plot_data[s][strategy] / single:.2f}x)" if strategy in plot_data[s] else "-"
                 for s in settings]
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    return lines


def parse_args(doc: str, strategies: list[str], steps: int) -> argparse.Namespace:
    """Arguments shared by the Trainer benchmarks (this one and step_timeline.py); ``--worker``
    and ``--out`` are how the launcher tells a rank what to run and where to write."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--settings", nargs="+", default=["hosts:2:1gbit"], help="shm:N or hosts:N:RATE")
    parser.add_argument("--strategies", nargs="+", default=strategies)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--timeout", type=float, default=600)
    return parser.parse_args()


def main() -> int:
    args = parse_args(__doc__, STRATEGIES, steps=12)
    if args.worker:
        worker(args.worker, args.steps, args.batch, args.out)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    single = run("shm:1", "mpi_allreduce", args.steps, args.batch, args.timeout)["step"]  # no exchange at W=1
    lines = [f"# throughput benchmark ({time.strftime('%Y-%m-%d %H:%M')}): MLP, per-rank batch {args.batch}, one rank alone {1000 * single:.0f} ms/step"]
    plot_data = {}
    for setting in args.settings:
        rows, base = [], None
        compute = run(setting, "compute", args.steps, args.batch, args.timeout)["step"]
        for strategy in args.strategies:
            r = run(setting, strategy, args.steps, args.batch, args.timeout)
            sps = r["world"] * r["batch"] / r["step"]
            base = sps if strategy == "ddp" else base
            alone = None
            if not is_ddp_peer(strategy) and r["world"] > 1:
                alone = run(setting, f"{strategy}:nooverlap", args.steps, args.batch, args.timeout)["exchange"]
            rows.append((strategy, r, sps, alone))
        lines.append(f"\n{setting} ({rows[0][1]['world']} ranks, {rows[0][1]['params']:,} params; compute alone, no exchange: {1000 * compute:.0f} ms/step)")
        lines.append("| strategy | samples/s | vs ddp | step (ms) | waiting on exchange (ms, % of step) | exchange alone (ms) | compute + exchange (ms) | overlap |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for strategy, r, sps, alone in rows:
            step_ms, wait_ms = 1000 * r["step"], 1000 * r["exchange"]
            wait = f"{wait_ms:.0f} ({100 * wait_ms / step_ms:.0f}%)" if not is_ddp_peer(strategy) else "-"
            serial = f"{1000 * (compute + alone):.0f}" if alone is not None else "-"
            overlap = ("yes" if r["step"] < compute + alone else "no") if alone is not None else "-"
            ratio = f"{sps / base:.2f}x" if base else "-"
            lines.append(f"| {strategy} | {sps:.1f} | {ratio} | {step_ms:.0f} | {wait} | {1000 * alone:.0f} | {serial} | {overlap} |" if alone is not None
                         else f"| {strategy} | {sps:.1f} | {ratio} | {step_ms:.0f} | {wait} | - | - | - |")
        plot_data[setting] = {s: sps for s, _, sps, _ in rows}
    lines += scaling_table(plot_data, args.batch / single)
    print("\n".join(lines))
    (RESULTS / f"throughput_b{args.batch}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, len(plot_data))
        for k, (setting, values) in enumerate(plot_data.items()):
            ax.bar([i + k * width for i in range(len(values))], list(values.values()), width, label=setting)
        ax.set_xticks([i + width * (len(plot_data) - 1) / 2 for i in range(len(args.strategies))], args.strategies, rotation=20)
        ax.set_ylabel("samples/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / f"throughput_b{args.batch}.png", dpi=120)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
