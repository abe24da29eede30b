"""``benchmarks/gpu_check.py`` without a GPU: its no-CUDA path, its dry run, and its report.

The check itself runs only on a GPU machine; what can be checked anywhere is checked here, in a few
seconds: without CUDA (``CUDA_VISIBLE_DEVICES=""`` hides any GPU) it says so, writes a report and
exits 0; the dry run lists every stage and every strategy name; and the report, fed the files the
stages write, renders every section and judges issue 16's targets.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lightning_mpi
from tests.mpi_utils import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_report  # noqa: E402

MiB = 2**20


def run_check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})), cwd=REPO)


def test_without_cuda_it_says_so_writes_a_report_and_exits_0(tmp_path):
    proc = run_check("--out", str(tmp_path / "report"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA device" in proc.stdout
    md = (tmp_path / "report" / "report.md").read_text()
    assert "No CUDA device" in md and "torch.cuda.is_available()" in md
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["machine"]["cuda"] is False and report["machine"]["torch"]
    statuses = {s["name"]: s["status"] for s in report["stages"]}
    assert statuses.pop("env") == "passed"
    assert set(statuses.values()) == {"skipped: no CUDA device"}


def test_dry_run_lists_every_stage_and_every_strategy_without_running_anything(tmp_path):
    proc = run_check("--dry-run", "--out", str(tmp_path / "never"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for stage in ("env", "cuda-tests", "strategies", "offload-search", "codecs", "offload-unet", "offload-gpt"):
        assert f"[{stage}]" in out
    for needed in ("pytest -q -m cuda", "mpiexec", "-n 2", "gpu_strategies.py", "codec_speed.py --device cuda",
                   "offload.py --device cuda --steps 3 --arms none", "--model gpt --precision bf16-mixed", "--cap-mb 16384",
                   "--search-only", "side by side", "timed, alone"):
        assert needed in out, needed
    strategies = out.split("strategies on 2 ranks:")[1].split()
    expected = [*gpu_check.SYNC_NAMES, *gpu_check.OTHER_NAMES]
    expected += [n for n in gpu_check.LATER_NAMES if n in lightning_mpi.STRATEGIES]  # mpi_zero* once registered
    for name in expected:
        assert name in strategies, name
    assert not (tmp_path / "never").exists()


def test_stages_can_be_chosen_and_unknown_ones_are_refused(capsys):
    assert gpu_check.main(["--dry-run", "--stages", "codecs"]) == 0
    out = capsys.readouterr().out
    assert "[env]" in out and "[codecs]" in out and "[strategies]" not in out
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--stages", "nope"])
    assert "--stages nope: unknown" in capsys.readouterr().err


def test_strategy_specs_follow_the_registry():
    registry = {k: v for k, v in lightning_mpi.STRATEGIES.items() if k != "mpi_zero_bf16"}
    specs, missing = gpu_check.strategy_specs({**registry, "mpi_zero": None})
    assert "mpi_zero" in specs and "mpi_zero_bf16" not in specs and not missing
    specs, missing = gpu_check.strategy_specs({k: v for k, v in lightning_mpi.STRATEGIES.items() if k != "mpi_onebit"})
    assert "mpi_onebit" not in specs and missing == ["mpi_onebit"]


def test_gpu_only_tests_say_so_with_the_cuda_marker():
    """``pytest -m cuda`` is how the check finds GPU tests, so no test may skip itself for lack of
    CUDA any other way."""
    offenders = []
    for path in (REPO / "tests").rglob("test_*.py"):
        text = path.read_text()
        if re.search(r"skipif\([^)]*cuda", text, flags=re.IGNORECASE | re.DOTALL):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_a_stage_that_outlives_its_time_is_killed_and_reported(tmp_path):
    """The stage's whole process group goes (mpiexec's ranks too); a failing stage is reported."""
    sleeper = gpu_check.Stage("sleep", "sleeps", [sys.executable, "-c", "import subprocess, sys, time; "
                                                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"], 60)
    gpu_check.run_stage(sleeper, tmp_path, limit_s=1)
    assert sleeper.status == "timed out after 1 s" and sleeper.seconds < 20
    failing = gpu_check.Stage("fail", "fails", [sys.executable, "-c", "print('why'); raise SystemExit(3)"], 60)
    gpu_check.run_stage(failing, tmp_path, limit_s=30)
    assert failing.status == "failed (exit 3)" and "why" in (tmp_path / failing.log).read_text()


def test_stages_that_time_nothing_run_side_by_side(tmp_path):
    """Each of two untimed stages waits for the other's mark: they pass only if they overlap."""
    def waits_for(mine, other):
        code = (f"import pathlib, sys, time; pathlib.Path({str(tmp_path / mine)!r}).touch(); end = time.time() + 30\n"
                f"while not pathlib.Path({str(tmp_path / other)!r}).exists():\n"
                "    time.sleep(0.05)\n    if time.time() > end: sys.exit(4)")
        return gpu_check.Stage(mine, mine, [sys.executable, "-c", code], 60)

    stages = [waits_for("a", "b"), waits_for("b", "a")]
    gpu_check.run_side_by_side(stages, tmp_path, deadline=time.perf_counter() + 120)
    assert [s.status for s in stages] == ["passed", "passed"]
    assert not any(s.timed for s in gpu_check.build_stages(tmp_path, []) if s.name in ("cuda-tests", "strategies", "offload-search"))
    assert all(s.timed for s in gpu_check.build_stages(tmp_path, []) if s.name in ("codecs", "offload-unet", "offload-gpt"))


def offload_row(mode, activation_mib, step_s, base_mib=1000):
    return {"mode": mode, "ok": True, "step_s": step_s, "base_alloc": base_mib * MiB, "peak_alloc": (base_mib + activation_mib) * MiB,
            "peak_reserved": (base_mib + activation_mib + 100) * MiB, "host_memory_stats": {"reserved_bytes.all.peak": 64 * MiB}}


def write_stage_outputs(out: Path) -> None:
    """What the stages of a GPU run leave, in their formats (one of each case the report handles)."""
    (out / "offload").mkdir(parents=True)
    (out / "cuda_tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.offload.test_tiers" name="test_cuda_weights_bitwise_identical[32-true-cpu]"/>'
        '<testcase classname="tests.comm.test_cupy_kernels" name="test_x"><skipped message="cupy not installed"/></testcase>'
        '<testcase classname="tests.data.test_module" name="test_cuda_batches"><failure message="assert 1 | 2">x</failure></testcase>'
        "</testsuite></testsuites>")
    ok_run = {"precision": "32-true", "diff": 1e-8, "mismatches": 0, "ranks_identical_end": True, "global_step": 6, "loss_last": 0.9,
              "grad_scaler": False, "scales": [None, None], "cupy_launches": 12, "failures": []}
    amp = dict(ok_run, precision="16-mixed", grad_scaler=True, scales=[65536.0, 65536.0], diff=2e-3)
    (out / "strategies.json").write_text(json.dumps({"device": "cuda", "world": 2, "steps": 6, "batch": 4, "gpu": "H100", "results": [
        {"spec": "mpi_asa16", "tolerance": 5e-3, "identical": "after every step", "fp32": ok_run, "amp": amp, "ok": True},
        {"spec": "mpi_downpour", "tolerance": None, "identical": "at the end", "ok": False,
         "fp32": dict(ok_run, ranks_identical_end=False, failures=["ranks differ at the end"]), "amp": amp}]}))
    (out / "codecs.json").write_text(json.dumps({"cupy": "cupy 14.2.0", "local": [
        {"codec": "fp16", "op": "encode", "numel": 25_000_000, "device": "cuda", "torch_ms": 1.0, "cupy_ms": 0.25},
        {"codec": "int8", "op": "encode+EF", "numel": 25_000_000, "device": "cuda", "torch_ms": 2.0, "cupy_ms": None}]}))
    (out / "offload_search").mkdir()  # the search is its own stage, run beside the tests
    (out / "offload_search" / "offload_cuda.json").write_text(json.dumps({
        "args": {"cap_mb": 16384.0}, "rows": [], "search": {"none": 160, "LMSOffload": 224}}))
    (out / "offload" / "offload_cuda.json").write_text(json.dumps({
        "args": {"cap_mb": 16384.0},
        "rows": [offload_row("none", 1000, 1.00), offload_row("torchtune", 500, 1.01), offload_row("LMSOffload", 350, 1.08),
                 offload_row("LMSOffload:prefetch=4", 520, 1.02),
                 {"mode": "checkpoint+torchtune", "ok": False, "skipped": "torchtune not installed"}]}))


@pytest.mark.plots  # the report draws two figures
def test_the_report_renders_every_section_and_judges_issue_16s_targets(tmp_path):
    write_stage_outputs(tmp_path)
    machine = {"cuda": True, "gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.1, "capability": "9.0", "driver": "550.54.15",
               "torch": "2.13.0", "torch_cuda": "12.8", "cupy": "14.2.0", "torchtune": "0.6.1", "mpi": "MPICH 5.0.2"}
    stages = [{"name": n, "what": n, "status": st, "seconds": 10.0, "timeout_s": 60.0, "log": f"logs/{n}.log"}
              for n, st in (("env", "passed"), ("cuda-tests", "failed (exit 1)"), ("offload-gpt", "timed out after 60 s"))]
    verdict = gpu_report.write_report(tmp_path, machine, stages, {"command": "gpu_check.py", "budget_s": 570, "missing_strategies": []})
    assert "cuda-tests" in verdict and "offload-gpt" in verdict and "mpi_downpour" in verdict
    md = (tmp_path / "report.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in md and "driver 550.54.15" in md and "cupy 14.2.0" in md
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    cut = next(v for k, v in rows.items() if k.startswith("LMSOffload cuts"))
    assert "-65% at +8.0%" in cut and cut.rstrip(" |").endswith("| met")
    torchtune = next(v for k, v in rows.items() if k.startswith("no worse than torchtune"))
    assert "LMSOffload:prefetch=4 520 MiB" in torchtune and torchtune.rstrip(" |").endswith("| met")  # the sweep's setting
    volume = next(v for k, v in rows.items() if k.startswith("trainable 3D volume"))
    assert "2.74x" in volume and volume.rstrip(" |").endswith("| met")
    assert "1 of 1 tests passed" in md and "1 passed, 1 failed, 1 skipped" in md
    assert "FAILED: ranks differ at the end" in md and "scale 65536" in md
    assert "4.00x" in md and "skipped: torchtune not installed" in md
    assert "## LMSOffload on a GPT-like model (bf16-mixed)" in md and "No results" in md
    assert (tmp_path / "stages.png").stat().st_size > 0 and (tmp_path / "codecs.png").stat().st_size > 0
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == verdict
