"""Open MPI's one-sided component: its default choice against ``OMPI_MCA_osc=^ucx`` (what
``import lightning_mpi`` sets where no RDMA device exists, see lightning_mpi/comm/mpienv.py).

    python benchmarks/osc_choice.py [--commits 40] [--mb 4]       # from the Open MPI environment

Launches 2 ranks per setting: rank 0 hosts half of a :class:`ShardedVector` of ``--mb`` MiB and
computes in torch with the progress thread serving its shard; rank 1 commits (``add``: Lock /
Accumulate / Unlock on every shard) and reads (``read``) the whole vector ``--commits`` times,
timing each. Prints one table row per setting: the component Open MPI selected, how many
``osc_ucx_component`` error lines the ranks printed, and the median and p90 times.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RANK = r"""
import sys, time, threading
import numpy as np, torch
from mpi4py import MPI
from lightning_mpi.comm.progress import ProgressThread
from lightning_mpi.comm.window import ShardedVector

torch.set_num_threads(1)
commits, mb = int(sys.argv[1]), float(sys.argv[2])
comm = MPI.COMM_WORLD
n = int(mb * 2**20 / 4) // 2 * 2
vec = ShardedVector(comm, n)
vec.init_local(torch.zeros(n))
thread = ProgressThread.probing(comm, 0.0005, "benchmark")
comm.Barrier()
if comm.rank == 0:
    done = comm.Ibarrier()
    a = torch.randn(256, 256)
    while not done.Test():  # computing in torch while rank 1 commits (the thread serves the shard)
        for _ in range(20):
            a = torch.tanh(a @ a)
else:
    delta, out, add_ms, read_ms = torch.ones(n), torch.empty(n), [], []
    for _ in range(commits):
        t = time.perf_counter(); vec.add(delta); add_ms.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter(); vec.read(out); read_ms.append((time.perf_counter() - t) * 1e3)
    assert float(out[0]) == commits and float(out[-1]) == commits, "an update was lost"
    stats = (np.median(add_ms), np.percentile(add_ms, 90), np.median(read_ms), np.percentile(read_ms, 90))
    print("RESULT", *stats, flush=True)
    comm.Ibarrier().Wait()
thread.close()
vec.free()
"""


def run(setting: str, commits: int, mb: float) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_osc")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), OMPI_MCA_osc_base_verbose="10")  # names the choice
    if setting != "default":
        env["OMPI_MCA_osc"] = setting
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-np", "2", "--bind-to", "none", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    out = subprocess.run(
        [*cmd, sys.executable, "-c", RANK, str(commits), str(mb)], env=env, capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0:
        raise SystemExit(f"{setting}: exit {out.returncode}\n{out.stderr[-3000:]}")
    text = out.stdout + out.stderr
    selected = sorted(set(re.findall(r"select: component (\w+) selected", text)))
    errors = text.count("osc_ucx_component.c")
    add_med, add_p90, read_med, read_p90 = map(float, re.search(r"RESULT (.*)", out.stdout).group(1).split())
    return (
        f"| `{setting}` | {','.join(selected)} | {errors} | {add_med:.2f} | {add_p90:.2f} | {read_med:.2f} | "
        f"{read_p90:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=40)
    parser.add_argument("--mb", type=float, default=4.0)
    args = parser.parse_args()
    print(
        f"| OMPI_MCA_osc | component | error lines | add median ms | add p90 ms | read median ms | read p90 ms |"
        f"  ({args.mb:g} MiB, {args.commits} commits, 2 ranks)"
    )
    print("|---|---|---|---|---|---|---|")
    for setting in ("default", "^ucx", "default", "^ucx"):
        print(run(setting, args.commits, args.mb), flush=True)


if __name__ == "__main__":
    main()
