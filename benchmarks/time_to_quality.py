#!/usr/bin/env python3
"""Time to quality: held-out loss against wall-clock time, every exchange rule beside Lightning's ddp peers.

The task (``benchmarks/ttq_task.py``): a byte-level language model over the Python standard
library's own source (held-out files kept apart), an embedding flattened into a wide MLP of about
17M parameters: little compute per byte of gradient, so the link sets the pace. AdamW (fused),
lr 3e-4, batch 16 per rank, the same seed and initial weights for every arm, each rank its own
shard of the training windows.

Each arm is a fresh ``mpiexec`` across simulated hosts (``benchmarks/cluster.py``: needs root)
and trains through a ``pytorch_lightning`` Trainer for a wall-clock budget T (``--budget``),
counted from the first training step (``benchmarks/ttq_worker.py``). A setting ``hosts:N:RATE``
(optionally ``:DELAY``, a one-way latency) is N hosts with one rank each, every host's link limited
to RATE; ``hosts:NxK:RATE[:DELAY]`` puts K ranks on each host (N·K ranks: launch ranks 0..K-1 on
the first host, K..2K-1 on the second, ...; ranks on one host talk over its loopback, only traffic
between hosts crosses the links); ``shm:N`` is N ranks on this machine's shared memory. Arms:

- peers: ``ddp``, ``ddp_fp16`` (which runs ``--peer-factor`` x T, so its loss at 3T and 5T can be
  read off its curve), ``ddp_powersgd1``, ``ddp_powersgd4`` (``benchmarks/ddp_peers.py``);
- ours: any registered strategy name (``mpi_asa16``, ``mpi_diloco``, ...; a name this checkout
  does not have is reported as "not available"); ``name:key=value,...`` overrides its arguments;
- ``local``: one process without any exchange, run for W·T (W: the most ranks of any setting),
  with a snapshot every ``T / LOCAL_POINTS_PER_T``: the real limit. Each arm's **effective
  speedup** is the time ``local`` needs to reach the arm's loss in T, divided by T (ideal W).

``--runs N`` runs ``local`` N times (local run k before round k of the first setting, so that the
local runs meet the load the arms meet) and, per setting, every arm once and then the headline arms
N - 1 times more (``ttq_report.headline_arms``: ``ddp_fp16``, the best PowerSGD peer, ``mpi_auto``
and the best fixed ``mpi_*`` arm of the first run; ``--repeat`` names them instead); the tables
show the mean and the spread. The long peer runs ``--peer-factor`` x T in its first run only.

An arm that fails is reported with its error; one that outlives its run plus ``--margin`` seconds
is killed (SIGKILL, the whole job) and reported as "hung", with how far it got. The run goes on.

    python benchmarks/time_to_quality.py                     # 4 settings x 13 arms, ~30 min
    python benchmarks/time_to_quality.py --settings hosts:2:100mbit --budget 10 --arms ddp local mpi_asa16
    python benchmarks/time_to_quality.py --smoke             # 2 ranks, shared memory, seconds
    python benchmarks/time_to_quality.py --settings hosts:2:10mbit:50ms --arms local mpi_streaming_diloco \
        mpi_streaming_diloco:wire=sparseloco                 # 10 Mbit/s links, 50 ms one-way latency
    python benchmarks/time_to_quality.py --settings hosts:2:100mbit --runs 3 --peer-factor 1 \
        --arms local ddp_fp16 ddp_powersgd1 mpi_auto mpi_diloco mpi_streaming_diloco
    python benchmarks/time_to_quality.py --settings hosts:2x2:10mbit:50ms --peer-factor 1 --arms local \
        mpi_hybrid:group_size=2 mpi_streaming_diloco mpi_asa ddp_fp16   # 2 hosts x 2 ranks

Per setting it prints a markdown table (loss in T; effective speedup; time to reach the best loss
ddp reaches in T; samples/s and steps/s against ``local``; ddp_fp16's loss at 3T and 5T and
whether each arm's loss in T is as low; peak bytes per exchange where the rule's ``stats()``
reports them; whether every rank ends with the same weights; on simulated hosts, the bytes that
crossed between the hosts, measured on the links), a table of each arm's effective speedup over
each peer's, and saves ``benchmarks/results/time_to_quality.json``, ``.md`` and one
PNG per setting (``ttq_report.py``: the curves, and the effective speedups beside them). The
curve points before the last are rank 0's own weights (a worker's, for local-step and asynchronous
rules); the last point is the weights ``fit`` leaves (the average or center). Figures depend on the machine and its load.

Link bytes (``hosts:`` settings; :func:`watch_progress`, ``SimCluster.traffic``): the bytes every
host's egress qdisc sent, less those the switch namespace's own stack received (``mpiexec``'s
control traffic, reported apart as ``mpiexec_bytes``): host-to-host frames with their Ethernet, IP
and TCP headers (ACKs and retransmissions included), each TSO/GSO segment with its own headers,
without preamble, FCS and inter-frame gap. ``link_bytes`` covers the whole arm (from before
``mpiexec`` starts to its exit: start-up, such as the process group and the first broadcast of the
weights, and the end included); ``link_bytes_training`` only the training, from rank 0's first step
to the end of its ``fit`` (the counters are read when rank 0's progress file says so, polled every
0.1 s); ``link_bytes_per_step`` is ``link_bytes_training`` over rank 0's steps.
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
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import ttq_report  # noqa: E402
from benchmarks.ddp_peers import is_ddp_peer  # noqa: E402
from benchmarks.ttq_task import TaskConfig  # noqa: E402
from benchmarks.ttq_worker import parse_arm  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WORKER = ROOT / "benchmarks" / "ttq_worker.py"
SETTINGS = ["hosts:2:1gbit", "hosts:2:100mbit", "hosts:4:1gbit", "hosts:4:100mbit"]
ARMS = ["local", "ddp", "ddp_fp16", "ddp_powersgd1", "ddp_powersgd4", "mpi_asa16", "mpi_asa_int8", "mpi_topk",
        "mpi_powersgd", "mpi_model_avg", "mpi_diloco", "mpi_streaming_diloco", "mpi_aeasgd"]
#: the peer that runs peer_factor x T
LONG_PEER = "ddp_fp16"
#: seconds an arm takes beyond its run (start-up: imports, data, process group; evaluation of the
#: snapshots): a base, plus per rank sharing a core (a rank imports torch and Lightning in ~5 CPU s)
OVERHEAD_BASE, OVERHEAD_PER_RANK_PER_CORE = 10.0, 5.0
#: this driver run: each arm run's speedup is read off the local runs of its own invocation
INVOCATION = f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}"
#: local snapshots per T: its curve is the yardstick of every effective speedup, so it is finer
LOCAL_POINTS_PER_T = 10
SMOKE_TASK = TaskConfig(hidden=256, train_bytes=1 << 20, held_out_bytes=64 << 10, train_windows=1 << 14,
                        held_out_windows=128)


def available(arm: str) -> bool:
    """Whether this checkout can run ``arm`` (``local``, a ddp peer or a registered strategy)."""
    name, _ = parse_arm(arm)
    if name == "local" or is_ddp_peer(name):
        return True
    from lightning_mpi.strategies.registry import STRATEGIES

    return name in STRATEGIES


def hosts_of(setting: str) -> tuple[int, int, str, str | None]:
    """``hosts:N:RATE[:DELAY]`` or ``hosts:NxK:RATE[:DELAY]`` -> (N hosts, K ranks per host, RATE, DELAY)."""
    _, layout, rate, *delay = setting.split(":")
    hosts, _, per_host = layout.partition("x")
    return int(hosts), int(per_host or 1), rate, delay[0] if delay else None


def world_of(setting: str) -> int:
    """Ranks of ``hosts:N:RATE[:DELAY]``, ``hosts:NxK:RATE[:DELAY]`` (N·K) or ``shm:N``."""
    if setting.startswith("hosts:"):
        hosts, per_host, _, _ = hosts_of(setting)
        return hosts * per_host
    return int(setting.split(":")[1])


def run_seconds(arm: str, args: argparse.Namespace, first: bool = True) -> float:
    """An arm's run: T; the long peer's first run ``peer_factor`` x T; ``local`` W·T (W: the most
    ranks of any setting)."""
    name = parse_arm(arm)[0]
    if name == "local":
        return args.budget * max([world_of(s) for s in args.settings] or [1])
    return args.budget * (args.peer_factor if name == LONG_PEER and first else 1)


def arm_marks(arm: str, run: float, budget: float) -> list[float]:
    """Snapshot times: ``local`` every ``T / LOCAL_POINTS_PER_T`` and at every multiple of T; others
    :func:`snapshot_marks`."""
    if parse_arm(arm)[0] != "local":
        return snapshot_marks(run, budget)
    points = max(10, round(run / budget * LOCAL_POINTS_PER_T))
    multiples = {k * budget for k in range(1, int(run / budget) + 1)}
    return sorted(set(snapshot_marks(run, budget, points)) | {m for m in multiples if m < run})


def snapshot_marks(run: float, budget: float, points: int = 10) -> list[float]:
    """When rank 0 snapshots its weights: ``points`` even steps over the run, plus T and 3T."""
    marks = {round(run * k / points, 6) for k in range(1, points)} | {budget, 3 * budget}
    return sorted(m for m in marks if 0 < m < run)


def _reason(stderr: str) -> str:
    """The most telling line of a failed job's output."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line or "error:" in line]
    return ((errors or lines or ["no output"])[-1])[:300]


def _progress(path: Path) -> str:
    try:
        p = json.loads(path.read_text())
    except (OSError, ValueError):
        return "rank 0 never reported (before or during start-up)"
    return f"rank 0 last reported: {p['phase']}, {p['steps']} steps, t={p['t']} s"


def _stacks(tmp: Path) -> dict[str, str]:
    """Each rank's Python stacks as its worker dumped them shortly before the arm was killed."""
    return {path.name.rsplit(".", 1)[-1]: path.read_text(errors="replace")
            for path in sorted(tmp.glob("stacks.*"))}


def watch_progress(progress: Path):
    """A :class:`~benchmarks.cluster.LinkReadings` watcher: the counters when rank 0's progress file
    first says it trains (``"training"``) and first says it has finished training (``"trained"``),
    polled every 0.1 s."""

    def watch(meter) -> None:
        while not meter.wait(0.1):
            try:
                phase = json.loads(progress.read_text())["phase"]
            except (OSError, ValueError, KeyError):  # not written yet, or caught mid-write
                continue
            key = "trained" if phase in ("evaluating", "done") else "training" if phase == "training" else None
            if key and key not in meter.readings:
                meter.take(key)

    return watch


def link_figures(meter, steps: int) -> dict:
    """``link_bytes`` (the whole arm), ``link_bytes_training``, ``link_bytes_per_step`` (None when the
    poll missed a phase) and ``mpiexec_bytes``: see the module docstring."""
    training = meter.between("training", "trained")
    return {"link_bytes": meter.between("start", "end"),
            "link_bytes_training": training,
            "link_bytes_per_step": training / steps if training is not None and steps else None,
            "mpiexec_bytes": meter.between("start", "end", "to_mpiexec")}


def run_arm(setting: str, arm: str, args: argparse.Namespace, task: TaskConfig, data: Path, cluster=None,
            first: bool = True) -> dict:
    """Run one arm in one setting (``cluster``: the setting's ``SimCluster``); its result dict with
    ``status`` ok / failed / hung, and the link bytes on a cluster."""
    run = run_seconds(arm, args, first)
    timeout = run + args.margin
    with tempfile.TemporaryDirectory(prefix="ttq-") as tmp:
        tmp = Path(tmp)
        spec = {"arm": arm, "run_seconds": run, "marks": arm_marks(arm, run, args.budget), "batch": args.batch,
                "task": asdict(task), "data": str(data), "out": str(tmp / "result.json"),
                "progress": str(tmp / "progress.json"),
                # every rank dumps its threads' Python stacks this long after it started, so that a
                # hung arm says where each rank waited (read back below before tmp is removed)
                "dump_stacks_after": max(1.0, timeout - 10.0)}
        (tmp / "spec.json").write_text(json.dumps(spec))
        cmd = [sys.executable, str(WORKER), str(tmp / "spec.json")]
        env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
        start = time.perf_counter()
        meter = None
        try:
            if cluster is not None:
                env["GLOO_SOCKET_IFNAME"] = cluster.iface
                from benchmarks.cluster import LinkReadings

                with LinkReadings(cluster, watch_progress(tmp / "progress.json"), "ttq-link-meter") as meter:
                    res = cluster.run_mpi(cmd, ranks_per_host=hosts_of(setting)[1], env=env, timeout=timeout)
            else:
                if setting != "local":
                    from lightning_mpi.launcher.checks import find_mpiexec

                    env["GLOO_SOCKET_IFNAME"] = "lo"
                    cmd = [find_mpiexec(), "-n", setting.split(":")[1], *cmd]
                res = _run_killable(cmd, dict(os.environ, **env), timeout)
        except subprocess.TimeoutExpired:
            return {"arm": arm, "status": "hung", "wall_seconds": time.perf_counter() - start,
                    "reason": f"no result within {timeout:.0f} s (run {run:.0f} s + margin {args.margin:.0f} s); "
                              f"killed; {_progress(tmp / 'progress.json')}",
                    "stacks": _stacks(tmp)}
        wall = time.perf_counter() - start
        out = tmp / "result.json"
        if res.returncode != 0 or not out.exists():
            return {"arm": arm, "status": "failed", "wall_seconds": wall,
                    "reason": f"exit {res.returncode}: {_reason(res.stderr + res.stdout)}"}
        # the strategies' own one-line reports (mpi_auto's choices), for the tables' readers
        notes = [line.strip() for line in res.stdout.splitlines() + res.stderr.splitlines()
                 if line.startswith("lightning_mpi:")]
        result = json.loads(out.read_text())
        link = link_figures(meter, result["steps"]) if meter is not None else {}
        return {**result, **link, "status": "ok", "wall_seconds": wall, "notes": notes, "invocation": INVOCATION}


def _run_killable(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout SIGKILL the whole group and re-raise."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_setting(setting: str, arms: list[str], args, task, data,
                before_round=None) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """Every arm (but ``local``) in ``setting`` once, then the arms to repeat ``args.runs - 1`` times
    more; one simulated cluster for all of them; ``before_round(k)`` is called before round k
    (1: every arm; 2..runs: the repeats). Returns (first runs, further runs per arm)."""
    results: dict[str, dict] = {}
    todo = [a for a in arms if a != "local"]
    for arm in todo:
        if not available(arm):
            results[arm] = {"arm": arm, "status": "not available", "reason": "not a strategy in this checkout"}
    runnable = [a for a in todo if a not in results]
    repeats: dict[str, list[dict]] = {}

    def go(cluster=None) -> None:
        if before_round:
            before_round(1)
        for arm in runnable:
            results[arm] = _logged(setting, arm, run_arm(setting, arm, args, task, data, cluster))
        again = [a for a in (args.repeat or ttq_report.headline_arms(results, args.budget)) if a in runnable]
        for run in range(2, args.runs + 1):
            if before_round:
                before_round(run)
            for arm in again:
                r = run_arm(setting, arm, args, task, data, cluster, first=False)
                repeats.setdefault(arm, []).append(_logged(f"{setting} run {run}", arm, r))

    if setting.startswith("hosts:") and runnable:
        from benchmarks.cluster import SimCluster

        hosts, _, rate, delay = hosts_of(setting)
        with SimCluster(hosts, rate=rate, delay=delay) as cluster:
            go(cluster)
    else:
        go()
    return {a: results[a] for a in todo}, repeats


def _logged(setting: str, arm: str, r: dict) -> dict:
    if r["status"] == "ok":
        line = f"loss {r['final_loss']:.3f}, {r['steps']} steps in {r['seconds']:.1f} s"
        if r.get("link_bytes") is not None:
            line += f", {r['link_bytes'] / 1e6:.1f} MB between hosts"
    else:
        line = r["reason"]
    print(f"[{setting}] {arm}: {r['status']} ({r['wall_seconds']:.0f} s wall): {line}", file=sys.stderr, flush=True)
    return r


def overhead_estimate(ranks: int) -> float:
    cores = len(os.sched_getaffinity(0))
    return OVERHEAD_BASE + OVERHEAD_PER_RANK_PER_CORE * max(1.0, ranks / cores)


def estimate_seconds(settings: list[str], arms: list[str], args) -> float:
    """Expected wall time of the whole run (no arm hanging; 4 arms repeated when ``--runs`` > 1)."""
    runnable = [a for a in arms if a != "local" and available(a)]
    # the headline arms are chosen after the first run: estimate them as the first four runnable
    again = [a for a in args.repeat if a in runnable] if args.repeat else runnable[:4]
    total = args.runs * (run_seconds("local", args) + overhead_estimate(1)) if "local" in arms else 0.0
    for setting in settings:
        ranks = world_of(setting)
        total += sum(run_seconds(a, args) + overhead_estimate(ranks) for a in runnable)
        total += (args.runs - 1) * sum(run_seconds(a, args, first=False) + overhead_estimate(ranks) for a in again)
    return total


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=None,
                   help="hosts:N:RATE[:DELAY] (N hosts, one rank each; DELAY: one-way latency in tc units, e.g. "
                   f"50ms), hosts:NxK:RATE[:DELAY] (K ranks per host) or shm:N (default {' '.join(SETTINGS)})")
    p.add_argument("--arms", nargs="+", default=None, help="strategy names, ddp peers, local (default: all 13)")
    p.add_argument("--budget", type=float, default=None, help="wall-clock seconds T per arm (default 15)")
    p.add_argument("--peer-factor", type=float, default=None, help=f"{LONG_PEER} runs this many T (default 5)")
    p.add_argument("--batch", type=int, default=16, help="per-rank batch")
    p.add_argument("--margin", type=float, default=None, help="seconds past its run before an arm counts as hung (default 90)")
    p.add_argument("--runs", type=int, default=1, help="runs of local and of the headline arms (default 1)")
    p.add_argument("--repeat", nargs="+", default=None,
                   help="the arms to run --runs times (default: ddp_fp16, the best ddp_powersgd*, mpi_auto, "
                        "the best fixed mpi_* arm of the first run)")
    p.add_argument("--add-to", default=None,
                   help="an earlier result JSON (the same T, batch and task): add this run's arm and local runs to "
                        "its runs, so that runs can be spread over several invocations; written to --out "
                        "(default: that file)")
    p.add_argument("--smoke", action="store_true", help="2 ranks on shared memory, a small model, a 3 s budget")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/time_to_quality[_smoke].json)")
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = {"settings": ["shm:2"] if smoke else SETTINGS, "arms": ["local", "ddp_fp16", "mpi_asa16"] if smoke else ARMS,
                "budget": 3.0 if smoke else 15.0, "peer_factor": 2.0 if smoke else 5.0, "margin": 60.0 if smoke else 90.0}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.budget <= 0 or args.peer_factor < 1:
        p.error(f"--budget={args.budget} must be > 0 and --peer-factor={args.peer_factor} >= 1")
    if args.runs < 1:
        p.error(f"--runs={args.runs} must be >= 1")
    return args


def _previous(args, task: TaskConfig) -> dict | None:
    """The report ``--add-to`` names, checked to be comparable (the same T, batch and task)."""
    if not args.add_to:
        return None
    previous = json.loads(Path(args.add_to).read_text())
    mine = {"budget": args.budget, "batch": args.batch, "task": asdict(task)}
    theirs = {**{k: previous["args"][k] for k in ("budget", "batch")}, "task": previous["task"]}
    for key, value in mine.items():
        if theirs[key] != value:
            raise SystemExit(f"--add-to={args.add_to}: it was run with {key}={theirs[key]!r}, this run has "
                             f"{value!r}; use the same --budget/--batch/--smoke, or another --out")
    return previous


def merge_reports(old: dict, new: dict) -> dict:
    """``new``'s runs added to ``old``'s: a new arm's runs, or further runs of an arm ``old`` has
    (appended to its repeats), and ``new``'s local runs after ``old``'s; loads and commands appended."""
    merged = {**old, "created": new["created"], "commands": old.get("commands", []) + new["commands"],
              "total_seconds": old["total_seconds"] + new["total_seconds"],
              "local_runs": (old.get("local_runs") or ([old["local"]] if old.get("local") else [])) + new["local_runs"],
              "settings": {s: dict(arms) for s, arms in old["settings"].items()},
              "repeats": {s: {a: list(runs) for a, runs in arms.items()} for s, arms in old.get("repeats", {}).items()}}
    load = dict(old.get("load", {}))
    for key, value in new["load"].items():
        load[key] = f"{load[key]}, then {value}" if key in load else value
    merged["load"] = load
    for setting, arms in new["settings"].items():
        first = merged["settings"].setdefault(setting, {})
        again = merged["repeats"].setdefault(setting, {})
        for arm, result in arms.items():
            runs = [result, *new["repeats"].get(setting, {}).get(arm, [])]
            if arm not in first or first[arm].get("status") == "not available":
                first[arm], runs = runs[0], runs[1:]
            again.setdefault(arm, []).extend(runs)
    return merged


def _load() -> str:
    """The load averages (1, 5, 15 min), as ``uptime`` prints them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    args = parse_args(argv)
    task = SMOKE_TASK if args.smoke else TaskConfig()
    tag = "time_to_quality_smoke" if args.smoke else "time_to_quality"
    out = Path(args.out) if args.out else Path(args.add_to) if args.add_to else RESULTS / f"{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    from benchmarks.ttq_task import load_texts

    data = RESULTS / f"ttq_data_{task.train_bytes}_{task.held_out_bytes}_{task.held_out_every}.pt"
    load_texts(task, data)
    estimate = estimate_seconds(args.settings, args.arms, args)
    print(f"# time to quality: {len(args.settings)} settings x {len(args.arms)} arms, T = {args.budget:g} s "
          f"({LONG_PEER}: {args.peer_factor:g} T); estimated total {estimate / 60:.1f} min "
          f"(+ up to {args.margin:g} s per hung arm)", file=sys.stderr, flush=True)
    previous = _previous(args, task)
    started = time.perf_counter()
    load = {"local": _load()} if "local" in args.arms else {}
    local_runs: list[dict] = []

    def local_run(k: int) -> None:
        """Local run k, before round k of the first setting: the local runs meet the same load as the arms."""
        if "local" in args.arms and len(local_runs) < k:
            local_runs.append(_logged(f"local run {k}", "local", run_arm("local", "local", args, task, data)))

    settings, repeats = {}, {}
    for i, s in enumerate(args.settings):
        load[s] = _load()
        settings[s], repeats[s] = run_setting(s, args.arms, args, task, data, local_run if i == 0 else None)
    for k in range(1, args.runs + 1):  # no setting, or fewer rounds than runs (no arm to repeat)
        local_run(k)
    report = {"created": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "task": asdict(task),
              "commands": [" ".join(["python", *sys.argv])], "total_seconds": time.perf_counter() - started,
              "estimated_seconds": estimate, "load": load, "local_runs": local_runs, "settings": settings,
              "repeats": repeats}
    if previous:
        report = merge_reports(previous, report)
    local_runs = report["local_runs"]
    report["local"] = local = local_runs[0] if local_runs else None
    report["summary"] = {s: ttq_report.summarize(r, local, args.budget, args.peer_factor, report["repeats"].get(s),
                                                 local_runs) for s, r in report["settings"].items()}
    out.write_text(json.dumps(report, indent=1))
    text = ttq_report.markdown(report)
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    for setting in report["settings"]:
        ttq_report.plot(report, setting, out.with_name(f"{out.stem}_{setting.replace(':', '_')}.png"))
    print(f"# total {report['total_seconds'] / 60:.1f} min; results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
