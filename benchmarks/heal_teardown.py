#!/usr/bin/env python3
"""Does a run that healed also *end*? Every rule's teardown after a heal, repeated.

    python benchmarks/heal_teardown.py [--rules mpi_downpour,mpi_gosgd] [--runs 10] [--heal shrink]   # .venv-ompi

Each run launches ``lightning-mpi --heal -n 3 --grace 3`` on this script's worker: a
``pytorch_lightning.Trainer`` on a tiny model with the rule's strategy (``heal=--heal``), ``--steps``
steps of about ``--step-ms`` each; the last rank SIGKILLs itself at the start of step ``--kill-step``.
A run passes when the launch exits 0 within ``--timeout`` seconds, every survivor reached
``max_steps`` and wrote its record (and, with ``--heal replace``, when the run grew back to 3
ranks, or a replacement that arrived after the end left quietly). A launch still running at the
timeout is killed (its process group) and counted as a hang.

``--late``: with ``--heal replace``, the survivors finish before the replacement can join (the kill
at step ``--steps - 2`` of short steps): the replacement arrives after training ended and must
leave with exit code 0, and the job too.

Prints one line per run and a table per rule; writes ``benchmarks/results/heal_teardown.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
#: the rules whose teardown is repeated by default: the one-sided ones (parameter server, gossip) first
RULES = (
    "mpi_downpour",
    "mpi_aeasgd",
    "mpi_eamsgd",
    "mpi_agn",
    "mpi_adag",
    "mpi_dynsgd",
    "mpi_gosgd",
    "mpi_allreduce",
    "mpi_asa16",
    "mpi_topk",
    "mpi_powersgd",
    "mpi_easgd",
    "mpi_model_avg",
    "mpi_diloco",
    "mpi_streaming_diloco",
    "mpi_zero",
    "mpi_auto",
)


def worker(out: Path, rule: str, heal: str, steps: int, kill_step: int, step_ms: float) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.strategies import StrategyRegistry
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_mpi  # noqa: F401  (registers the names)

    torch.set_num_threads(1)
    replacement = bool(os.environ.get("LIGHTNING_MPI_REPLACEMENT"))
    from mpi4py import MPI

    launch_rank = MPI.COMM_WORLD.Get_rank() if not replacement else 100 + os.getpid() % 1000

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def on_train_batch_start(self, batch, batch_idx):
            if self.global_step == kill_step and not replacement and launch_rank == 2:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

        def training_step(self, batch, _):
            time.sleep(step_ms / 1000)
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    entry = StrategyRegistry[rule]
    strategy = entry["strategy"](**{**entry["init_params"], "heal": heal})
    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=8, shuffle=True))
    healing = strategy._core.healing
    record = {
        "launch_rank": launch_rank,
        "global_step": trainer.global_step,
        "world_size": trainer.world_size,
        "heals": healing.events,
        "replaced": healing.replaced,
        "t_end": time.time(),
    }
    (out / f"done.{launch_rank}.json").write_text(json.dumps(record))


def one_run(
    rule: str, heal: str, steps: int, kill_step: int, step_ms: float, timeout: float, hang_timeout: float, gdb: bool
) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "lightning_mpi", "-n", "3", "--heal", "--grace", "3"]
        cmd += ["--hang-timeout", str(hang_timeout), __file__]
        cmd += ["--worker", out, rule, heal, str(steps), str(kill_step), str(step_ms)]
        start = time.time()
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        stacks: dict[int, str] = {}
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            ranks = _processes_with(f"--worker\0{out}")
            if gdb:
                stacks = {pid: _stack(pid) for pid in ranks}
            mpirun = {_parent(pid) for pid in ranks} - {os.getpid(), proc.pid}
            for pid in [*ranks, *mpirun, proc.pid]:  # the ranks, mpirun, the launcher
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            stdout, stderr = proc.communicate()
            code = "hung"
        seconds = time.time() - start
        done = [json.loads(p.read_text()) for p in Path(out).glob("done.*.json")]
        survivors = [d for d in done if d["launch_rank"] in (0, 1)]
        new = [d for d in done if d["launch_rank"] >= 100]
        row = {
            "exit": code,
            "seconds": round(seconds, 1),
            "survivors_at_max_steps": sum(d["global_step"] == steps for d in survivors),
            "end_world": sorted({d["world_size"] for d in done}),
            "replacements_done": len(new),
            # the launcher ended a job still in MPI_Finalize --grace seconds after training finished
            "stopped_after_finish": "had not ended --grace seconds later" in stderr,
            "last_end_to_exit_s": round(time.time() - max((d["t_end"] for d in done), default=start), 1)
            if done
            else None,
        }
        row["ok"] = code == 0 and row["survivors_at_max_steps"] == 2
        if not row["ok"]:
            row["stderr"] = stderr[-3000:]
        if stacks:
            row["stacks"] = stacks
        return row


def _processes_with(text: str) -> list[int]:
    """The pids of the processes whose command line holds ``text`` (a launch's OUT: its ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes() and int(entry.name) != os.getpid():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return pid


def _stack(pid: int) -> str:
    """Every thread's native stack of a hung rank (gdb; py-spy cannot read these processes)."""
    try:
        gdb = subprocess.run(
            ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
            capture_output=True, text=True, timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"gdb failed: {error}"
    return "\n".join(line for line in gdb.stdout.splitlines() if line.startswith(("Thread", "#")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--heal", default="shrink", choices=("shrink", "replace"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-step", type=int, default=12)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--hang-timeout", type=float, default=8.0, help="lightning-mpi's (8: its default)")
    parser.add_argument("--gdb", action="store_true", help="a hung launch: every rank's native stacks (gdb)")
    parser.add_argument("--late", action="store_true", help="replace: the replacement arrives after the end")
    parser.add_argument("--out", default=str(RESULTS / "heal_teardown.json"))
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        out, rule, heal, steps, kill_step, step_ms = args.worker
        worker(Path(out), rule, heal, int(steps), int(kill_step), float(step_ms))
        return
    if args.late:
        args.heal, args.kill_step = "replace", args.steps - 2
    table = []
    for rule in args.rules.split(","):
        runs = []
        for i in range(args.runs):
            row = one_run(
                rule, args.heal, args.steps, args.kill_step, args.step_ms, args.timeout, args.hang_timeout, args.gdb
            )
            runs.append(row)
            shown = {k: v for k, v in row.items() if k not in ("stderr", "stacks")}
            print(json.dumps({"rule": rule, "run": i, **shown}), flush=True)
            if not row["ok"]:
                print(row["stderr"][-1500:], file=sys.stderr, flush=True)
            for pid, stack in row.get("stacks", {}).items():
                print(f"--- rank process {pid}\n{stack}", file=sys.stderr, flush=True)
        passed = sum(r["ok"] for r in runs)
        table.append({"rule": rule, "heal": args.heal, "runs": len(runs), "passed": passed, "detail": runs})
    print(f"\n| rule | heal | passed | hung | other failures | median s per launch |")
    print("|---|---|---|---|---|---|")
    for row in table:
        hung = sum(r["exit"] == "hung" for r in row["detail"])
        seconds = sorted(r["seconds"] for r in row["detail"])
        print(
            f"| `{row['rule']}` | {row['heal']} | {row['passed']}/{row['runs']} | {hung} | "
            f"{row['runs'] - row['passed'] - hung} | {seconds[len(seconds) // 2]:.1f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "table": table}, indent=2))


if __name__ == "__main__":
    main()
