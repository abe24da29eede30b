"""The report of ``benchmarks/gpu_check.py``: ``report.md``, ``report.json`` and plots in one folder.

Reads what the stages left in the folder (``env.json``, ``cuda_tests.xml``, ``strategies.json``,
``codecs.json``, ``offload/offload_cuda*.json``) and judges issue 16's targets from them. A stage
that did not run or left nothing shows as such; nothing here needs torch or a GPU.
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from offload_report import table as offload_table

MiB = 2**20
#: the verdict of a check in which every stage passed
PASSED = "every stage passed"


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- what each stage left ------------------------------------------------------------------------
def cuda_tests(out: Path) -> list[dict] | None:
    """One entry per test in the junit file: id, outcome (passed/failed/skipped), message."""
    try:
        root = ElementTree.parse(out / "cuda_tests.xml").getroot()
    except (OSError, ElementTree.ParseError):
        return None
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = (child.get("message") or child.text or "").strip()
                message = text.splitlines()[0][:200].replace("|", "\\|") if text else ""
                break
        tests.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "message": message})
    return tests


def codec_rows(out: Path) -> tuple[list[dict], str | None]:
    data = _load(out / "codecs.json") or {}
    return data.get("local", []), data.get("cupy")


def _gbs(numel: int, ms: float | None) -> float | None:
    return None if not ms else 4 * numel / (ms * 1e-3) / 1e9


# --- issue 16's targets ----------------------------------------------------------------------------
def _row(rows: list[dict], mode: str) -> dict | None:
    return next((r for r in rows if r.get("mode") == mode and "step_s" in r), None)


def _activation(r: dict) -> float:
    return r["peak_alloc"] - r["base_alloc"]


def targets(offload: dict, tests: list[dict] | None) -> list[tuple[str, str, str]]:
    """(target, what was measured, verdict) for issue 16's targets."""
    result = []
    unet = (offload.get("unet") or {}).get("rows", [])
    none, lms, tt = _row(unet, "none"), _row(unet, "LMSOffload"), _row(unet, "torchtune")
    if none and lms:
        cut, overhead = 1 - _activation(lms) / _activation(none), lms["step_s"] / none["step_s"] - 1
        verdict = "met (goal too)" if cut >= 0.70 and overhead <= 0.05 else "met" if cut >= 0.60 and overhead <= 0.10 else "not met"
        result.append(("LMSOffload cuts peak activation memory >= 60% at <= 10% step time (goal 70% at 5%), 3D U-Net",
                       f"-{100 * cut:.0f}% at {100 * overhead:+.1f}%", verdict))
    else:
        result.append(("LMSOffload: >= 60% activation memory at <= 10% step time", "no U-Net none/LMSOffload rows", "not measured"))
    if lms and tt:
        # At equal memory: the fastest LMSOffload setting (defaults or the prefetch sweep) whose
        # activation peak is within 5% of torchtune's, against torchtune's step time.
        settings = [r for r in unet if r.get("mode", "").startswith("LMSOffload") and "step_s" in r]
        fits = [r for r in settings if _activation(r) <= 1.05 * _activation(tt)]
        best = min(fits or settings, key=lambda r: r["step_s"])
        verdict = "met" if fits and best["step_s"] <= 1.05 * tt["step_s"] else "not met"
        result.append(("no worse than torchtune's OffloadActivations at equal memory (within 5%)",
                       f"{best['mode']} {_activation(best) / MiB:.0f} MiB, {best['step_s']:.3f} s; torchtune {_activation(tt) / MiB:.0f} MiB, "
                       f"{tt['step_s']:.3f} s", verdict))
    else:
        result.append(("no worse than torchtune's OffloadActivations", "torchtune arm skipped or missing", "not measured"))
    search = (offload.get("unet") or {}).get("search") or {}
    if search.get("none") and search.get("LMSOffload"):
        ratio = (search["LMSOffload"] / search["none"]) ** 3
        result.append(("trainable 3D volume under a 16 GB cap >= 2x", f"{search['none']}^3 -> {search['LMSOffload']}^3: {ratio:.2f}x",
                       "met" if ratio >= 2 else "not met"))
    else:
        result.append(("trainable 3D volume under a 16 GB cap >= 2x", "no search result", "not measured"))
    if tests is None:
        result.append(("weights bitwise identical with deterministic=True", "no CUDA test results", "not measured"))
        result.append(("every CUDA test passes", "no CUDA test results", "not measured"))
        return result
    bitwise = [t for t in tests if "weights_bitwise_identical" in t["id"]]
    ok_bitwise = bitwise and all(t["outcome"] == "passed" for t in bitwise)
    result.append(("weights bitwise identical with deterministic=True (LMSOffload cpu/disk x 32/16/bf16)",
                   f"{sum(t['outcome'] == 'passed' for t in bitwise)} of {len(bitwise)} tests passed",
                   "met" if ok_bitwise else "not met" if bitwise else "not measured"))
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    result.append(("every CUDA test passes", f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped",
                   "met" if counts["failed"] == 0 and counts["skipped"] == 0 and counts["passed"] else "not met"))
    return result


# --- plots --------------------------------------------------------------------------------------
def _plots(out: Path, stages: list[dict], codecs: list[dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(7, 3))
    names = [s["name"] for s in stages]
    ax.barh(names, [s["timeout_s"] for s in stages], color="#dddddd", label="timeout")
    ax.barh(names, [s["seconds"] for s in stages], color=["#228833" if s["status"] == "passed" else "#ee6677" for s in stages],
            label="took (green: passed)")
    ax.set_xlabel("seconds")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "stages.png", dpi=110)
    plt.close(fig)
    made.append("stages.png")
    largest = max((r["numel"] for r in codecs), default=0)
    rows = [r for r in codecs if r["numel"] == largest]
    if rows:
        labels = [f"{r['codec']} {r['op']}" for r in rows]
        fig, ax = plt.subplots(figsize=(10, 3.8))
        x = range(len(rows))
        for i, impl in enumerate(("torch", "cupy")):
            values = [_gbs(r["numel"], r.get(f"{impl}_ms")) or 0 for r in rows]
            ax.bar([j + (i - 0.5) * 0.4 for j in x], values, width=0.4, label=impl, color=["#4477aa", "#ee6677"][i])
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("GB/s of fp32 input")
        ax.set_title(f"codecs on CUDA, {largest / 1e6:g}M floats, one rank of 2 (loopback)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "codecs.png", dpi=110)
        plt.close(fig)
        made.append("codecs.png")
    return made


# --- the report ---------------------------------------------------------------------------------
def _machine_lines(m: dict) -> list[str]:
    gpu = f"{m.get('gpu')} ({m.get('gpu_memory_gib')} GiB, compute capability {m.get('capability')})" if m.get("cuda") else "none"
    return [
        f"- GPU: {gpu}; driver {m.get('driver', 'unknown')}; CUDA (torch) {m.get('torch_cuda')}",
        f"- torch {m.get('torch')}; cupy {m.get('cupy', 'unknown')}; torchtune {m.get('torchtune', 'unknown')}; "
        f"Lightning {m.get('pkg:lightning', m.get('pkg:pytorch-lightning', 'unknown'))}",
        f"- MPI: {m.get('mpi', 'unknown')}; CUDA-aware: {m.get('mpi_cuda_aware', 'unknown')}",
        f"- commit {m.get('commit', 'unknown')}, {m.get('date', '')}, Python {m.get('python', '?')}",
    ]


def _strategy_lines(data: dict | None) -> list[str]:
    if not data:
        return ["No results (the stage did not run or left nothing)."]
    lines = [f"{data['world']} ranks on one {data.get('device')} ({data.get('gpu') or ''}), {data['steps']} steps of batch {data['batch']} "
             "per rank, against one process at batch 2B.", "",
             "| strategy | ranks identical | fp32: max abs diff vs one process (tolerance) | AMP 16-mixed: scale, diff | cupy launches | result |",
             "|---|---|---|---|---:|---|"]
    for e in data["results"]:
        f, a = e.get("fp32", {}), e.get("amp")
        tol = f" ({e['tolerance']:g})" if e.get("tolerance") else " (not equivalent by design)"
        fp32 = f.get("error") or f"{f.get('diff', float('nan')):.2e}{tol}"
        amp = "n/a" if a is None else a.get("error") or f"scale {a['scales'][0]:g}, {a['diff']:.2e}"
        launches = sum(r.get("cupy_launches", 0) for r in (f, a or {}))
        failures = [*f.get("failures", []), *((a or {}).get("failures", []))]
        lines.append(f"| `{e['spec']}` | {e['identical']} | {fp32} | {amp} | {launches} | "
                     f"{'ok' if e['ok'] else 'FAILED: ' + '; '.join(failures)} |")
    return lines


def _codec_lines(rows: list[dict], cupy: str | None) -> list[str]:
    if not rows:
        return ["No results (the stage did not run or left nothing)."]
    lines = [f"cupy: {cupy}. GB/s of fp32 input, wall time between `torch.cuda.synchronize()`, median.", "",
             "| codec | op | floats | torch ms | torch GB/s | cupy ms | cupy GB/s | speed-up |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t, c = r.get("torch_ms"), r.get("cupy_ms")
        gt, gc = _gbs(r["numel"], t), _gbs(r["numel"], c)
        lines.append(f"| {r['codec']} | {r['op']} | {r['numel'] / 1e6:g}M | {t:.3f} | {gt:.1f} | "
                     + (f"{c:.3f} | {gc:.1f} | {t / c:.2f}x |" if c else "skipped | | |"))
    return lines


def _offload_lines(data: dict | None, image: str) -> list[str]:
    if not data:
        return ["No results (the stage did not run or left nothing)."]
    lines = [offload_table(data["rows"], "cuda"), "", "* against the none run"]
    search = data.get("search") or {}
    if search.get("none") is not None and "LMSOffload" in search:
        n, m = search["none"], search["LMSOffload"]
        lines.append(f"\nLargest side that trains under {data['args']['cap_mb']:.0f} MiB: none {n}^3, LMSOffload {m}^3"
                     + (f" ({(m / n) ** 3:.2f}x the volume)." if n else "."))
    lines.append(f"\n![]({image})")
    return lines


def write_report(out: Path, machine: dict, stages: list[dict], context: dict) -> str:
    """Write report.md, report.json and the plots; return a one-line verdict."""
    tests = cuda_tests(out)
    strategies = _load(out / "strategies.json")
    codecs, cupy = codec_rows(out)
    offload = {"unet": _load(out / "offload" / "offload_cuda.json"), "gpt": _load(out / "offload" / "offload_cuda_gpt.json")}
    search = _load(out / "offload_search" / "offload_cuda.json")  # its own stage, run beside the tests
    if search and search.get("search"):
        offload["unet"] = {**(offload["unet"] or {"rows": []}), "search": search["search"]}
    goals = targets(offload, tests) if machine.get("cuda") else []
    bad = [s["name"] for s in stages if s["status"] not in ("passed", "not run") and not s["status"].startswith("skipped")]
    failed_specs = [e["spec"] for e in (strategies or {}).get("results", []) if not e["ok"]]
    verdict = ("no CUDA device: nothing ran" if not machine.get("cuda") else
               PASSED if not bad and not failed_specs else
               f"stages not passed: {', '.join(bad) or 'none'}; strategies failed: {', '.join(failed_specs) or 'none'}")
    plots = _plots(out, stages, codecs) if machine.get("cuda") else []
    md = ["# GPU check", "", f"`{context.get('command', 'gpu_check.py')}` (budget {context.get('budget_s', 0):.0f} s): **{verdict}**.", "",
          *_machine_lines(machine), ""]
    if not machine.get("cuda"):
        md += ["No CUDA device: `torch.cuda.is_available()` is False on this machine, so no stage ran. "
               "Run `python benchmarks/gpu_check.py` on a GPU machine (docs/gpu.md).", ""]
    md += ["## Stages", "", "| stage | what | status | seconds | log |", "|---|---|---|---:|---|"]
    for s in stages:
        log = f"[{s['log']}]({s['log']})" if s["log"] else ""
        md.append(f"| {s['name']} | {s['what'][:120]} | {s['status']} | {s['seconds']:.0f} | {log} |")
    md += ["", "![](stages.png)" if "stages.png" in plots else "", ""]
    if goals:
        md += ["## Issue 16's targets", "", "| target | measured | verdict |", "|---|---|---|", *[f"| {t} | {m} | {v} |" for t, m, v in goals], ""]
    if machine.get("cuda"):
        md += ["## CUDA tests (`pytest -m cuda`)", ""]
        md += ["| test | outcome | message |", "|---|---|---|", *[f"| `{t['id']}` | {t['outcome']} | {t['message']} |" for t in tests]] \
            if tests else ["No results (the stage did not run or left nothing)."]
        md += ["", "## Strategies, 2 ranks on one GPU", "", *_strategy_lines(strategies)]
        if context.get("missing_strategies"):
            md.append(f"\nNot registered, so not run: {', '.join(context['missing_strategies'])}.")
        md += ["", "## Codecs: torch against cupy", "", *_codec_lines(codecs, cupy)] + (["", "![](codecs.png)"] if "codecs.png" in plots else [])
        md += ["", "## LMSOffload on the 3D U-Net (fp32)", "", *_offload_lines(offload["unet"], "offload/offload_cuda.png")]
        md += ["", "## LMSOffload on a GPT-like model (bf16-mixed)", "", *_offload_lines(offload["gpt"], "offload/offload_cuda_gpt.png")]
    (out / "report.md").write_text("\n".join(md) + "\n")
    report = {"verdict": verdict, "machine": machine, "context": context, "stages": stages, "targets": goals, "cuda_tests": tests,
              "strategies": strategies, "codecs": {"cupy": cupy, "rows": codecs}, "offload": offload, "plots": plots}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return verdict
