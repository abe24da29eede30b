"""Tables and plots of ``benchmarks/offload.py`` (its driver imports these)."""
from __future__ import annotations

import argparse
from pathlib import Path

MiB = 2**20


def _peak(r: dict, device: str) -> int:
    return r["peak_alloc"] if device == "cuda" else r["peak_rss"]


def _base(r: dict, device: str) -> int:
    return r["base_alloc"] if device == "cuda" else r["base_rss"]


def _pinned_peak(r: dict) -> int:
    """Peak pinned host bytes of a CUDA run, as torch's host allocator reports them (0 if unknown)."""
    stats = r.get("host_memory_stats", {})
    return max([v for k, v in stats.items() if "peak" in k and "reserved" in k] or [v for k, v in stats.items() if "peak" in k] or [0])


def table(rows: list[dict], device: str) -> str:
    what = "max_memory_allocated" if device == "cuda" else "peak RSS"
    suffix = " (glibc defaults)"
    refs = {r["mode"]: r for r in rows}
    cuda = device == "cuda"
    lines = [
        f"| run | {what} (MiB) | training peak above start (MiB) | vs none* | step time (s) | vs none* | offloaded/step (MiB) "
        f"| copy hidden / exposed (ms) |" + (" max_memory_reserved (MiB) | pinned peak (MiB) |" if cuda else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if cuda else ""),
    ]
    for r in rows:
        if not r.get("ok", True) or "step_s" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r.get('error')}"
            lines.append(f"| {r['mode']} | {why} | | | | | | |" + (" | |" if cuda else ""))
            continue
        ref = refs.get("none" + suffix if r["mode"].endswith(suffix) else "none", rows[0])  # same allocator
        act, ref_act = _peak(r, device) - _base(r, device), _peak(ref, device) - _base(ref, device)
        copy = f"{r['hidden_ms']:.0f} / {r['exposed_ms']:.0f}" if "hidden_ms" in r else ""
        off = f"{r['offloaded'] / MiB:.0f}" if "offloaded" in r else ""
        lines.append(
            f"| {r['mode']} | {_peak(r, device) / MiB:.0f} | {act / MiB:.0f} | {100 * (act / ref_act - 1):+.0f}% "
            f"| {r['step_s']:.2f} | {r['step_s'] / ref['step_s']:.2f}x | {off} | {copy} |"
            + (f" {r.get('peak_reserved', 0) / MiB:.0f} | {_pinned_peak(r) / MiB:.0f} |" if cuda else "")
        )
    return "\n".join(lines)


def plot(rows: list[dict], search: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "step_s" in r and "glibc" not in r["mode"]]
    names = [r["mode"] for r in ok]
    crowded = len(ok) > 3 or max(map(len, names), default=0) > 12  # long arm names: slant them
    fig, axes = plt.subplots(1, 3 if search else 2, figsize=(13 if search else 9, 4.5 if crowded else 3.8))
    base = [_base(r, args.device) / MiB for r in ok]
    above = [(_peak(r, args.device) - _base(r, args.device)) / MiB for r in ok]
    axes[0].bar(names, base, color="#bbbbbb", label="at training start")
    axes[0].bar(names, above, bottom=base, color="#4477aa", label="training peak above it")
    axes[0].set_ylabel("max_memory_allocated (MiB)" if args.device == "cuda" else "peak RSS (MiB)")
    axes[0].legend(fontsize=8)
    axes[1].bar(names, [r["step_s"] for r in ok], color="#ee6677")
    axes[1].set_ylabel("step time (s)")
    for ax in axes[:2]:
        model = (f"GPT-like, {args.depth} x {args.width}, {args.batch} x {args.seq} tokens, {args.precision}" if args.model == "gpt"
                 else f"3D U-Net ({args.channels} ch, {args.convs} convs/block), {args.side}^3")
        ax.set_title(f"{args.device}, {model}", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        if crowded:
            plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    if search:
        sides = [search["none"], search["LMSOffload"]]
        axes[2].bar(["none", "LMSOffload"], [s**3 / 1e6 for s in sides], color="#228833")
        for i, s in enumerate(sides):
            axes[2].text(i, s**3 / 1e6, f"{s}^3", ha="center", va="bottom", fontsize=8)
        axes[2].set_ylabel("largest volume that trains (Mvoxel)")
        axes[2].set_title(f"under a {args.cap_mb:.0f} MiB cap", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def mlp_table(rows: list[dict], arms: list[tuple[str, str]]) -> str:
    """Peak RSS and step time against no offload under glibc's defaults (what a user without
    settings compares with) and against no offload under the same allocator settings."""
    by_arm = dict(zip(arms, rows))
    ref = by_arm[("none", "defaults")]
    lines = [
        "| run | allocator | peak RSS (MiB) | vs none (defaults) | above start (MiB) | step (s) | vs none (defaults) "
        "| vs none (same allocator) | CPU user + sys (s) | minor faults | copy hidden / exposed (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (mode, alloc), r in by_arm.items():
        if "step_s" not in r:
            lines.append(f"| {mode} | {alloc} | failed: {r.get('error')} | | | | | | | | |")
            continue
        same = by_arm[("none", alloc)]
        copy = f"{r['hidden_ms']:.0f} / {r['exposed_ms']:.0f}" if "hidden_ms" in r else ""
        same_ratio = f"{r['step_s'] / same['step_s']:.2f}x" if "step_s" in same else ""
        lines.append(
            f"| {mode} | {alloc} | {r['peak_rss'] / MiB:.0f} | {r['peak_rss'] / ref['peak_rss']:.2f}x "
            f"| {(r['peak_rss'] - r['base_rss']) / MiB:.0f} | {r['step_s']:.2f} | {r['step_s'] / ref['step_s']:.2f}x "
            f"| {same_ratio} | {r['user_s']:.2f} + {r['sys_s']:.2f} | {r['minflt']:.0f} | {copy} |"
        )
    return "\n".join(lines)
