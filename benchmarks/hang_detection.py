#!/usr/bin/env python3
"""How long a hung rank holds the survivors up, and whether a live rank that computes for long is
ever taken for a hung one: ``lightning-mpi --heal --hang-timeout S --freeze-timeout F``.

    python benchmarks/hang_detection.py [--timeouts 2,5,10] [--freeze-timeouts 0,2] [--runs 3]   # .venv-ompi

Open MPI's heartbeat detector (``--hang-timeout``) and the watchdog beside each rank
(``--freeze-timeout``, 0: off; ``lightning_mpi.comm.watchdog``) side by side, every pair of them.
Each run launches ``lightning-mpi --heal -n 3 --hang-timeout S --freeze-timeout F`` on this script's worker: a Lightning
``Trainer`` with ``SyncStrategy(heal="shrink")`` on a tiny model, steps of ``--step-ms``. At step 10
the last rank SIGSTOPs itself (a frozen process: every thread stopped) after writing the time; the
survivors record the wall time of every step. Reported per timeout (medians over runs): hang ->
the survivors' next completed step (the heal included), and whether the frozen process was gone at
the end (a survivor on its host kills it). A ``--busy`` run instead makes one rank compute for
``2 x S`` seconds without any MPI call at step 10 (no fault): a false positive would heal it away.

Writes ``benchmarks/results/hang_detection.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
FAULT_STEP = 10
STEPS = 30


def worker(out: Path, mode: str, step_ms: float, busy_s: float) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_mpi

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)
            self.times: list[tuple[int, float, int]] = []

        def training_step(self, batch, _):
            if self.global_step == FAULT_STEP and self.global_rank == self.trainer.world_size - 1:
                if mode == "stop":
                    (out / "frozen").write_text(json.dumps({"t": time.time(), "pid": os.getpid()}))
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif mode == "busy":
                    end = time.perf_counter() + busy_s
                    while time.perf_counter() < end:  # compute without any MPI call
                        pass
            time.sleep(step_ms / 1000)
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, *args):
            self.times.append((self.global_step, time.time(), self.trainer.world_size))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    model = Net()
    trainer = pl.Trainer(
        strategy=lightning_mpi.SyncStrategy(heal="shrink", min_ranks=1),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8))
    frozen_alive = None
    if (out / "frozen").exists():
        try:
            os.kill(json.loads((out / "frozen").read_text())["pid"], 0)
            frozen_alive = True
        except ProcessLookupError:
            frozen_alive = False
    (out / f"times.{trainer.global_rank}.json").write_text(
        json.dumps({"times": model.times, "frozen_alive": frozen_alive, "world": trainer.world_size})
    )


def one_run(timeout: float, freeze: float, mode: str, step_ms: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "lightning_mpi", "-n", "3", "--heal", "--hang-timeout", str(timeout)]
        cmd += ["--freeze-timeout", str(freeze)]
        cmd += ["--grace", "3", __file__, "--worker", out, mode, str(step_ms), str(2 * timeout)]
        start = time.time()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            return {"failed": proc.returncode, "stderr": proc.stderr[-2000:]}
        results = [json.loads(p.read_text()) for p in Path(out).glob("times.*.json")]
        row: dict = {"ranks_at_end": sorted(r["world"] for r in results), "seconds": time.time() - start}
        if mode == "stop":
            frozen = json.loads((Path(out) / "frozen").read_text())["t"]
            # the survivors' first step completed over the healed run (world size 2)
            after = [t for r in results for _, t, world in r["times"] if t > frozen and world < 3]
            row["hang_to_next_step_s"] = min(after) - frozen
            row["frozen_alive"] = [r["frozen_alive"] for r in results]
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeouts", default="2,5,10", help="--hang-timeout values (Open MPI's detector)")
    parser.add_argument("--freeze-timeouts", default="0,1", help="--freeze-timeout values (0: no watchdog)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--busy", action="store_true", help="also check for false positives (long compute)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        out, mode, step_ms, busy_s = args.worker
        worker(Path(out), mode, float(step_ms), float(busy_s))
        return
    table = []
    pairs = [(float(t), float(f)) for t in args.timeouts.split(",") for f in args.freeze_timeouts.split(",")]
    for timeout, freeze in pairs:
        runs = [one_run(timeout, freeze, "stop", args.step_ms) for _ in range(args.runs)]
        ok = [r for r in runs if "failed" not in r]
        row = {
            "hang_timeout_s": timeout,
            "freeze_timeout_s": freeze,
            "runs": len(runs),
            "failed": len(runs) - len(ok),
            "hang_to_next_step_s": statistics.median(r["hang_to_next_step_s"] for r in ok) if ok else None,
            "frozen_killed": all(alive is False for r in ok for alive in r["frozen_alive"]),
        }
        if args.busy:
            busy = one_run(timeout, freeze, "busy", args.step_ms)
            row["busy_2x_timeout_ranks_at_end"] = busy.get("ranks_at_end", busy)
        table.append({**row, "detail": runs})
        print(json.dumps({k: v for k, v in row.items()}), flush=True)
    print(
        "\n| --hang-timeout s | --freeze-timeout s | runs | hang -> next step s (median) | frozen process killed "
        "| busy 2x --hang-timeout: ranks at end |"
    )
    print("|---|---|---|---|---|---|")
    for row in table:
        print(
            f"| {row['hang_timeout_s']:g} | {row['freeze_timeout_s']:g} | "
            f"{row['runs'] - row['failed']}/{row['runs']} | {row['hang_to_next_step_s']:.2f} | "
            f"{row['frozen_killed']} | {row.get('busy_2x_timeout_ranks_at_end', '-')} |"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hang_detection.json").write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
