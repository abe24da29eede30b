#!/usr/bin/env python3
"""Every CUDA path of lightning_mpi on a GPU, in one command, within one time budget.

    python benchmarks/gpu_check.py --out gpu_report/          # on a GPU machine (< 10 min on one H100)
    python benchmarks/gpu_check.py --dry-run                   # what it would run, on any machine
    python benchmarks/gpu_check.py --stages strategies codecs  # some stages only

It installs nothing: it uses what ``pip install -e ".[dev,cuda]"`` (and, optionally, torchtune)
put in the environment; a missing optional package turns its part into "skipped: ... not
installed" in the report. The stages, each a fresh process with its own timeout (a stage that
times out or fails is reported, never fatal):

- ``env``: GPU, driver, CUDA, torch, cupy, torchtune, Lightning and MPI versions; whether torch
  sees a CUDA device. Without one the check says so, writes a report saying so, and exits 0.
- ``cuda-tests``: ``pytest -m cuda tests``, every test marked ``cuda`` (the offload tiers on the
  device, the data module's side-stream copies, the cupy kernels bit-exact against torch).
- ``strategies``: ``mpiexec -n 2`` on the one GPU (``tests/scripts/gpu_strategies.py``): every sync
  and compressed strategy, ``mpi_zero``/``mpi_zero_bf16`` when registered, ``mpi_downpour`` and
  ``mpi_diloco``, plus the exact settings of the lossy ones; equivalence with one process,
  identical ranks, and AMP ``16-mixed`` with a GradScaler.
- ``codecs``: ``benchmarks/codec_speed.py --device cuda``: torch's codec code against the cupy kernels.
- ``offload-search``: the largest 3D U-Net volume that trains under a 16 GB cap, without and with
  LMSOffload (``benchmarks/offload.py --search-only``).
- ``offload-unet``, ``offload-gpt``: ``benchmarks/offload.py --device cuda --arms ...`` on the 3D
  U-Net and on a GPT-like model in bf16-mixed.

The stages that time nothing (``cuda-tests``, ``strategies``, ``offload-search``) run side by side
after ``env``; the timed ones (``codecs``, ``offload-unet``, ``offload-gpt``) then run alone.

The report (``report.md``, ``report.json``, plots) is written by ``benchmarks/gpu_report.py``,
after every stage and at the end, into ``--out``. Exit status: 0 when every stage passed (or there
is no CUDA device), 1 when a stage failed or timed out or a strategy failed its checks.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

#: Synchronous and compressed strategy names that must run; mpi_zero* when they are registered.
SYNC_NAMES = ("mpi_allreduce", "mpi_asa", "mpi_asa16", "mpi_asa_bf16", "mpi_asa_int8", "mpi_topk", "mpi_onebit", "mpi_powersgd")
LATER_NAMES = ("mpi_zero", "mpi_zero_bf16")
#: two asynchronous rules (one-sided windows, a mailbox), and DiLoCo
OTHER_NAMES = ("mpi_downpour", "mpi_gosgd", "mpi_diloco")
#: settings under which a lossy strategy equals one process (checked against it as well)
EXACT_SPECS = ("mpi_topk@ratio=1.0+topk_packing=pairs", "mpi_powersgd@rank=64+min_compression_rate=0.0+error_feedback=false",
               "mpi_diloco@period=1+outer_lr=1.0+outer_momentum=0.0")
#: seconds kept for writing the report at the end
REPORT_RESERVE_S = 15.0
#: LMSOffload arms timed on the GPU (each a fresh process, about 20 s on an H100, mostly start-up):
#: what issue 16's targets are judged on, and the prefetch sweep's far end
UNET_ARMS = ("none", "save_on_cpu", "torchtune", "LMSOffload", "LMSOffload:prefetch=4", "checkpoint", "checkpoint+LMSOffload")
GPT_ARMS = ("none", "torchtune", "LMSOffload", "checkpoint+LMSOffload")


@dataclass
class Stage:
    name: str
    what: str
    command: list[str]
    timeout_s: float
    artifacts: list[str] = field(default_factory=list)  # files in --out the report reads
    #: False for a stage that measures no time: those run side by side, before the timed ones,
    #: which run alone so that nothing else on the machine moves their figures
    timed: bool = False
    status: str = "not run"  # passed | failed (exit N) | timed out after N s | skipped: why
    seconds: float = 0.0
    log: str = ""


def strategy_specs(registered) -> tuple[list[str], list[str]]:
    """(specs to run, required names that are not registered)."""
    names = [n for n in (*SYNC_NAMES, *LATER_NAMES, *OTHER_NAMES) if n in registered]
    exact = [s for s in EXACT_SPECS if s.partition("@")[0] in registered]
    missing = [n for n in (*SYNC_NAMES, *OTHER_NAMES) if n not in registered]
    return names + exact, missing


def mpiexec() -> str:
    from lightning_mpi.launcher.checks import find_mpiexec

    try:
        return find_mpiexec()
    except Exception:  # reported by the stage that uses it
        return "mpiexec"


def build_stages(out: Path, specs: list[str]) -> list[Stage]:
    py = sys.executable
    offload = [py, str(HERE / "offload.py"), "--device", "cuda", "--steps", "3"]
    return [
        Stage("env", "GPU, driver and package versions; is there a CUDA device?",
              [py, str(HERE / "gpu_check.py"), "--env-json", str(out / "env.json")], 60, ["env.json"]),
        Stage("cuda-tests", "every test marked cuda (pytest -m cuda)",
              [py, "-m", "pytest", "-q", "-m", "cuda", "-rA", "-p", "no:cacheprovider", "--junitxml", str(out / "cuda_tests.xml"),
               str(REPO / "tests")], 200, ["cuda_tests.xml"]),
        Stage("strategies", "2 ranks on the one GPU: " + ", ".join(specs),
              [mpiexec(), "-n", "2", py, str(REPO / "tests" / "scripts" / "gpu_strategies.py"), str(out / "strategies.json"), *specs],
              180, ["strategies.json"]),
        Stage("offload-search", "the largest 3D U-Net volume that trains under a 16 GB cap, without and with LMSOffload",
              # 192..448 in steps of 64: on an H100 none fits 256 and not 320 (one trial ~20 s)
              [*offload, "--search-only", "--side", "160", "--cap-mb", "16384", "--search-start", "192", "--side-step", "64",
               "--max-side", "448", "--results", str(out / "offload_search")],
              240, ["offload_search/offload_cuda.json"]),
        Stage("codecs", "codec speed on CUDA, torch against cupy",
              [py, str(HERE / "codec_speed.py"), "--device", "cuda", "--sizes", "1", "25", "--repeat", "7",
               "--json", str(out / "codecs.json")], 60, ["codecs.json"], timed=True),
        Stage("offload-unet", "LMSOffload arms on the 3D U-Net (160^3, fp32)",
              [*offload, "--arms", *UNET_ARMS, "--side", "160", "--no-search", "--results", str(out / "offload")],
              200, ["offload/offload_cuda.json", "offload/offload_cuda.png"], timed=True),
        Stage("offload-gpt", "LMSOffload arms on a GPT-like model in bf16-mixed",
              [*offload, "--arms", *GPT_ARMS, "--model", "gpt", "--precision", "bf16-mixed", "--no-search",
               "--results", str(out / "offload")],
              140, ["offload/offload_cuda_gpt.json", "offload/offload_cuda_gpt.png"], timed=True),
    ]


def run_stage(stage: Stage, out: Path, limit_s: float) -> None:
    """Run one stage in its own process group; kill the group when it outlives ``limit_s``."""
    log_path = out / "logs" / f"{stage.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stage.log = str(log_path.relative_to(out))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    for leaked in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        env.pop(leaked, None)
    begin = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(stage.command) + "\n")
        log.flush()
        try:
            proc = subprocess.Popen(stage.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        except OSError as error:
            stage.status = f"failed: {error}"
            return
        try:
            rc = proc.wait(timeout=limit_s)
            stage.status = "passed" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the stage's own group: mpiexec and its ranks too
            proc.wait()
            stage.status = f"timed out after {limit_s:.0f} s"
    stage.seconds = time.perf_counter() - begin


def run_within(stage: Stage, out: Path, deadline: float, budget: float) -> None:
    """:func:`run_stage` with its timeout cut to what is left of the budget (skipped under 10 s)."""
    left = deadline - time.perf_counter() - REPORT_RESERVE_S
    if left < 10:
        stage.status = f"skipped: the {budget:.0f} s budget was spent"
    else:
        print(f"[{stage.name}] {stage.what} ...", flush=True)
        run_stage(stage, out, min(stage.timeout_s, left))
    print(f"[{stage.name}] {stage.status} ({stage.seconds:.0f} s)", flush=True)


def run_side_by_side(stages: list[Stage], out: Path, deadline: float) -> None:
    """Run stages that measure no time at once, each in its own thread and process group with its
    own timeout: on a 16-core GPU machine the CUDA tests, the 2 ranks and the volume search share
    it without slowing one another much, and the check ends minutes sooner."""
    budget = deadline - time.perf_counter()
    threads = [threading.Thread(target=run_within, args=(stage, out, deadline, budget)) for stage in stages]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def env_info() -> dict:
    """What the env stage writes (run in its own process: it imports torch, cupy and MPI)."""
    import platform
    from importlib import metadata

    import torch

    info: dict = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "cuda": torch.cuda.is_available(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        info["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["commit"] = "unknown"
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count(),
                    capability=f"{props.major}.{props.minor}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["driver"] = smi.stdout.strip().splitlines()[0].split(",")[-1].strip() if smi.returncode == 0 and smi.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        info["driver"] = "unknown (no nvidia-smi)"
    for package in ("cupy-cuda12x", "cupy-cuda13x", "cupy", "torchtune", "torchao", "lightning", "pytorch-lightning", "mpi4py", "mpich"):
        try:
            info[f"pkg:{package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    from lightning_mpi.comm import cupy_kernels

    cupy = cupy_kernels.cupy_module()
    info["cupy"] = cupy.__version__ if cupy is not None else f"skipped: cupy not installed ({cupy_kernels.why_not()})"
    info["torchtune"] = info.get("pkg:torchtune", "skipped: torchtune not installed")
    return info


def mpi_info() -> dict:
    """The MPI library and whether it is CUDA-aware (initialises MPI: a singleton, in the env stage's
    own process; MPICH aborts a process that queries before MPI_Init)."""
    try:
        from mpi4py import MPI

        from lightning_mpi.comm.cuda import mpi_is_cuda_aware

        return {"mpi": MPI.Get_library_version().strip().splitlines()[0], "mpi_cuda_aware": mpi_is_cuda_aware()}
    except Exception as error:  # reported, not fatal
        return {"mpi": f"unknown ({type(error).__name__}: {error})"}


def report(out: Path, machine: dict, stages: list[Stage], context: dict) -> str:
    """Write the report; a bug in it must not cost the stages still to run (a GPU's time is rare)."""
    from gpu_report import write_report

    try:
        return write_report(out, machine, [asdict(s) for s in stages], context)
    except Exception:
        import traceback

        traceback.print_exc()
        (out / "report.json").write_text(json.dumps({"report_error": traceback.format_exc(), "machine": machine,
                                                     "stages": [asdict(s) for s in stages]}, indent=1, default=str))
        return "the report could not be written (see report.json)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "gpu_report", help="report directory (default: gpu_report/)")
    ap.add_argument("--budget", type=float, default=570.0, help="seconds for the whole check (default 570: under 10 min)")
    ap.add_argument("--stages", nargs="+", default=None, help="run only these stages (env always runs)")
    ap.add_argument("--dry-run", action="store_true", help="print every stage and command, run nothing")
    ap.add_argument("--env-json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.env_json:  # the env stage's worker: what torch says first, then MPI (which could abort)
        info = env_info()
        args.env_json.write_text(json.dumps(info, indent=1))
        args.env_json.write_text(json.dumps({**info, **mpi_info()}, indent=1))
        return 0

    import lightning_mpi  # no torch, no Lightning: only the table of names

    specs, missing = strategy_specs(lightning_mpi.STRATEGIES)
    out = args.out.resolve()
    stages = build_stages(out, specs)
    known = [s.name for s in stages]
    if args.stages:
        unknown = sorted(set(args.stages) - set(known))
        if unknown:
            ap.error(f"--stages {' '.join(unknown)}: unknown; choose from {' '.join(known)}")
        stages = [s for s in stages if s.name == "env" or s.name in args.stages]
    if args.dry_run:
        print(f"gpu_check dry run: {len(stages)} stages, budget {args.budget:.0f} s, report in {out}")
        for stage in stages:
            how = ("first, alone" if stage is stages[0] else "timed, alone" if stage.timed
                   else "side by side with the other untimed stages")
            print(f"\n[{stage.name}] {stage.what} (timeout {stage.timeout_s:.0f} s; {how})\n  $ {' '.join(stage.command)}")
        print(f"\nstrategies on 2 ranks: {' '.join(specs)}")
        if missing:
            print(f"not registered (reported as missing): {' '.join(missing)}")
        return 0

    from gpu_report import PASSED

    out.mkdir(parents=True, exist_ok=True)
    for stage in build_stages(out, specs):  # a report shows this run's results only
        for artifact in stage.artifacts:
            (out / artifact).unlink(missing_ok=True)
    deadline = time.perf_counter() + args.budget
    context = {"budget_s": args.budget, "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
               "specs": specs, "missing_strategies": missing}
    env = stages[0]
    run_stage(env, out, env.timeout_s)
    if not (out / "env.json").exists():
        for stage in stages[1:]:
            stage.status = "skipped: the env stage failed"
        report(out, {"cuda": False}, stages, context)
        print(f"gpu_check: the env stage {env.status}; see {out / env.log}")
        return 1
    machine = json.loads((out / "env.json").read_text())
    if not machine.get("cuda"):
        for stage in stages[1:]:
            stage.status = "skipped: no CUDA device"
        report(out, machine, stages, context)
        print(f"gpu_check: no CUDA device (torch {machine.get('torch', '?')}: torch.cuda.is_available() is False); "
              f"nothing to run. Report: {out / 'report.md'}")
        return 0
    print(f"gpu_check: {machine.get('gpu')} (driver {machine.get('driver')}), torch {machine.get('torch')}, cupy {machine.get('cupy')}",
          flush=True)
    untimed = [stage for stage in stages[1:] if not stage.timed]
    timed = [stage for stage in stages[1:] if stage.timed]
    run_side_by_side(untimed, out, deadline)
    report(out, machine, stages, context)
    for stage in timed:
        run_within(stage, out, deadline, args.budget)
        report(out, machine, stages, context)  # a report even if the check is cut short
    verdict = report(out, machine, stages, context)
    print(f"gpu_check: {verdict}. Report: {out / 'report.md'}")
    return 0 if verdict == PASSED else 1


if __name__ == "__main__":
    sys.exit(main())
