"""Tables and plots of the time-to-quality benchmark (``benchmarks/time_to_quality.py``).

:func:`summarize` turns one setting's raw arm results into the figures the tables show:

- ``loss_T``: held-out loss reached in the budget T: the final weights' loss (for the long peer,
  the first point of its curve at or after T);
- ``time_to_ddp_best``: the first time the arm's curve is at or below the best loss ``ddp``
  reached in T (None: not reached);
- ``samples_per_s`` (all ranks) and ``steps_per_s`` (rank 0), and both over ``local``'s;
- the long peer's loss at T, 3T and its last point (``peer_factor`` T), and for every arm
  whether ``loss_T`` is no worse than each;
- ``peak_exchange_bytes``: the largest exchange rank 0's rule reported (None: it reports none);
- ``same_weights``: every rank ends with bit-identical weights;
- ``link_bytes``, ``link_bytes_training``, ``link_bytes_per_step`` (simulated hosts only): the bytes
  that crossed between the hosts, measured on the links (TCP/IP and Ethernet headers included):
  over the whole arm (start-up included), over its training only, and the latter per step of rank 0
  (``time_to_quality``'s docstring says how they are measured);
- ``speedup``: the **effective speedup**: the time one process without any exchange (``local``,
  run for W·T) needs to reach the arm's loss in T, divided by T (ideal: W). The time is read off
  the local curve by linear interpolation between its snapshots (:func:`time_to_reach`), averaged
  over the local runs of the arm run's own invocation (``invocation``: the same load), or over
  every local run when its invocation has none; an arm whose loss no local run reaches gets a
  lower bound (the local run's length / T, flagged ``lower_bound``). With ``--runs N`` the arms chosen by :func:`headline_arms`
  run N times: ``loss_T`` and ``speedup`` are then the mean, with the spread in ``*_runs``
  (:func:`aggregate`);
- ``speedup_fit``: the same, read off one monotone (non-increasing) least-squares fit of every
  local point of the yardstick runs (:func:`monotone_curve`, isotonic regression) instead of each
  raw curve. A single run's held-out loss jumps by up to 0.1 nats/byte between snapshots 1.5 s
  apart (AdamW at batch 16), and the first crossing of such a curve lands on its earliest dip,
  which biases the raw figure low; the fit pools the runs and removes that bias. Both are shown;
- ``vs_peers``: for each of our arms, its mean effective speedup over each ddp peer's; a ratio is
  bounded by W over the peer's own speedup, which ``_reference`` gives as ``peer_bound``.
"""
from __future__ import annotations

from pathlib import Path

LONG_PEER = "ddp_fp16"
#: the prefix of the PowerSGD peers (``ddp_powersgd1``, ``ddp_powersgd4``)
POWERSGD_PEER = "ddp_powersgd"


def arm_name(arm: str) -> str:
    """``"mpi_diloco:period=20"`` -> ``"mpi_diloco"``."""
    return arm.partition(":")[0]


def is_peer(arm: str) -> bool:
    return arm_name(arm).startswith("ddp")


def time_to_reach(curve: list[tuple[float, float]], loss: float) -> float | None:
    """The first time the piecewise-linear curve ``[(seconds, loss), ...]`` is at or below ``loss``.

    Linear between the two snapshots around the first crossing; the first point when it already is
    as low; None when no point of the curve is.
    """
    if not curve:
        return None
    t_prev, l_prev = curve[0]
    if l_prev <= loss:
        return t_prev
    for t, value in curve[1:]:
        if value <= loss:
            return t_prev + (t - t_prev) * (l_prev - loss) / (l_prev - value)
        t_prev, l_prev = t, value
    return None


def effective_speedup(loss: float, local_curves: list[list[tuple[float, float]]], budget: float) -> tuple[float, bool]:
    """(time one process needs to reach ``loss``, averaged over ``local_curves``, / ``budget``; lower bound?).

    A local curve that never reaches ``loss`` counts its last time and makes the result a lower bound.
    """
    if not local_curves:
        raise ValueError("effective_speedup needs at least one local curve (run the `local` arm)")
    times, bound = [], False
    for curve in local_curves:
        t = time_to_reach(curve, loss)
        if t is None:
            t, bound = curve[-1][0], True
        times.append(t)
    return sum(times) / len(times) / budget, bound


def monotone_curve(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Every point of ``curves`` pooled and fitted by one non-increasing function of time
    (isotonic least squares by pool-adjacent-violators: a run of points that rises is replaced by
    its mean): ``[(seconds, fitted loss)]`` sorted by time."""
    pooled = sorted(p for curve in curves for p in curve)
    blocks: list[list[float]] = []  # [sum, count] of each pooled block, in time order
    for _, loss in pooled:
        blocks.append([loss, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(int(count))]
    return [(t, v) for (t, _), v in zip(pooled, fitted, strict=True)]


def effective_speedup_fit(loss: float, local_curves: list[list[tuple[float, float]]],
                          budget: float) -> tuple[float, bool]:
    """:func:`effective_speedup` read off :func:`monotone_curve` of ``local_curves`` (one fit of all)."""
    if not local_curves:
        raise ValueError("effective_speedup_fit needs at least one local curve (run the `local` arm)")
    return effective_speedup(loss, [monotone_curve(local_curves)], budget)


def aggregate(values: list[float]) -> dict | None:
    """Mean, min, max, sample standard deviation and count of ``values`` (None when empty)."""
    if not values:
        return None
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return {"mean": mean, "min": min(values), "max": max(values), "std": std, "n": len(values)}


def loss_in_T(arm: str, r: dict, budget: float) -> float | None:
    """The loss an arm reached in T: its final weights', or the long peer's curve at T."""
    return loss_at(r, budget) if arm_name(arm) == LONG_PEER else r["final_loss"]


def headline_arms(results: dict[str, dict], budget: float) -> list[str]:
    """The arms to repeat, from one run's results: ``ddp_fp16``, the PowerSGD peer with the lowest
    loss in T, every ``mpi_auto`` arm, and the fixed ``mpi_*`` arm with the lowest loss in T."""
    ok = {a: r for a, r in results.items() if r.get("status") == "ok"}
    best = lambda arms: [min(arms, key=lambda a: loss_in_T(a, ok[a], budget))] if arms else []  # noqa: E731
    ours = [a for a in ok if arm_name(a).startswith("mpi_")]
    auto = [a for a in ours if arm_name(a) == "mpi_auto"]
    return ([a for a in ok if arm_name(a) == LONG_PEER] + best([a for a in ok if arm_name(a).startswith(POWERSGD_PEER)])
            + auto + best([a for a in ours if a not in auto]))


def points(r: dict) -> list[tuple[float, float]]:
    """(seconds, held-out loss) of an arm's curve, ending with the final weights."""
    return [(p["t"], p["loss"]) for p in r["curve"]] + [(r["seconds"], r["final_loss"])]


def loss_at(r: dict, t: float) -> float | None:
    """The first point at or after ``t`` (the snapshot taken when the clock passed ``t``)."""
    later = [loss for s, loss in points(r) if s >= t - 1e-9]
    return later[0] if later else None


def summarize(results: dict[str, dict], local: dict | None, budget: float, peer_factor: float,
              repeats: dict[str, list[dict]] | None = None, local_runs: list[dict] | None = None) -> dict[str, dict]:
    """One setting's rows: ``results`` is every arm's first run, ``repeats`` the further runs of some
    arms, ``local`` the first local run and ``local_runs`` all of them (default ``[local]``)."""
    ok = {a: r for a, r in results.items() if r["status"] == "ok"}
    ddp = ok.get("ddp")
    ddp_best = min(loss for t, loss in points(ddp)) if ddp else None
    peer = ok.get(LONG_PEER)
    peer_losses = {"T": loss_at(peer, budget), "3T": loss_at(peer, 3 * budget), "last": peer["final_loss"]} if peer else {}
    local_ok = local if local and local.get("status") == "ok" else None
    locals_ok = [r for r in (local_runs if local_runs is not None else [local]) if r and r.get("status") == "ok"]
    local_curves = [points(r) for r in locals_ok]
    by_invocation: dict = {}
    for x in locals_ok:
        by_invocation.setdefault(x.get("invocation"), []).append(points(x))

    def yardstick(x: dict) -> list:
        """The local runs of ``x``'s own invocation (the same load), else every local run."""
        return by_invocation.get(x.get("invocation")) or local_curves if x.get("invocation") else local_curves
    summary = {}
    for arm, r in results.items():
        if r["status"] != "ok":
            summary[arm] = {"status": r["status"], "reason": r.get("reason", "")}
            continue
        loss_T = loss_in_T(arm, r, budget)
        reached = [t for t, loss in points(r) if ddp_best is not None and loss <= ddp_best]
        sps, steps_ps = r["samples"] / r["seconds"], r["steps"] / r["seconds"]
        row = {"status": "ok", "loss_T": loss_T, "time_to_ddp_best": reached[0] if reached else None,
               "samples_per_s": sps, "steps_per_s": steps_ps, "steps": r["steps"], "world": r["world"],
               "peak_exchange_bytes": r.get("peak_exchange_bytes"), "same_weights": r.get("same_weights"),
               "link_bytes": r.get("link_bytes"), "link_bytes_training": r.get("link_bytes_training"),
               "link_bytes_per_step": r.get("link_bytes_per_step"), "notes": r.get("notes") or []}
        if local_ok:
            row["samples_vs_local"] = sps / (local_ok["samples"] / local_ok["seconds"])
            row["steps_vs_local"] = steps_ps / (local_ok["steps"] / local_ok["seconds"])
        for key, value in peer_losses.items():
            comparable = arm != LONG_PEER and value is not None and loss_T is not None
            row[f"le_{LONG_PEER}_{key}"] = (loss_T <= value) if comparable else None
        runs = [r] + [x for x in (repeats or {}).get(arm, []) if x["status"] == "ok"]
        losses = [loss_in_T(arm, x, budget) for x in runs]
        row["loss_T_runs"] = aggregate(losses)
        row["failed_runs"] = 1 + len((repeats or {}).get(arm, [])) - len(runs)
        if local_curves:
            speedups = [effective_speedup(loss, yardstick(x), budget) for loss, x in zip(losses, runs, strict=True)]
            row["speedup_runs"] = aggregate([v for v, _ in speedups])
            row["speedup"] = row["speedup_runs"]["mean"]
            row["speedup_lower_bound"] = any(b for _, b in speedups)
            fits = [effective_speedup_fit(loss, yardstick(x), budget) for loss, x in zip(losses, runs, strict=True)]
            row["speedup_fit_runs"] = aggregate([v for v, _ in fits])
            row["speedup_fit"] = row["speedup_fit_runs"]["mean"]
            row["speedup_fit_lower_bound"] = any(b for _, b in fits)
        summary[arm] = row
    peers = {a: row["speedup"] for a, row in summary.items() if is_peer(a) and row.get("speedup") is not None}
    for arm, row in summary.items():
        if row.get("speedup") is not None and not is_peer(arm):
            row["vs_peers"] = {p: (row["speedup"] / v if v > 0 else None) for p, v in peers.items()}
    world = max((row["world"] for row in summary.values() if row.get("world")), default=None)
    local_ref = None
    if local_ok:
        local_ref = {"loss_T": loss_at(local_ok, budget), "loss_last": local_ok["final_loss"],
                     "seconds": local_ok["seconds"],
                     "samples_per_s": local_ok["samples"] / local_ok["seconds"],
                     "steps_per_s": local_ok["steps"] / local_ok["seconds"], "runs": len(locals_ok),
                     "loss_T_runs": aggregate([loss_at(x, budget) for x in locals_ok]),
                     "loss_last_runs": aggregate([x["final_loss"] for x in locals_ok])}
    summary["_reference"] = {"ddp_best_loss_in_T": ddp_best, f"{LONG_PEER}_loss": peer_losses, "local": local_ref,
                             "world": world, "peer_speedup": peers,
                             "peer_bound": {p: (world / v if world and v > 0 else None) for p, v in peers.items()}}
    return summary


def _f(value, fmt: str = "{:.3f}", none: str = "-") -> str:
    return none if value is None else fmt.format(value)


def _bytes(n: float | None) -> str:
    if not n:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _link(row: dict) -> str:
    """``73.20 MB (12.10 MB)``: the bytes between the hosts over the whole arm (over its training)."""
    if row.get("link_bytes") is None:
        return "-"
    return f"{_bytes(row['link_bytes'])} ({_bytes(row.get('link_bytes_training'))})"


def _yes(value) -> str:
    return "-" if value is None else ("yes" if value else "**no**")


def _spread(agg: dict | None, fmt: str = "{:.3f}", prefix: str = "") -> str:
    """``3.120`` for one run, ``3.120 [3.101, 3.135] (3 runs)`` for several."""
    if agg is None:
        return "-"
    text = prefix + fmt.format(agg["mean"])
    if agg["n"] > 1:
        text += f" [{fmt.format(agg['min'])}, {fmt.format(agg['max'])}] ({agg['n']} runs)"
    return text


def _speedup(row: dict, key: str = "speedup") -> str:
    return _spread(row.get(f"{key}_runs"), "{:.2f}", "≥ " if row.get(f"{key}_lower_bound") else "")


def markdown(report: dict) -> str:
    args = report["args"]
    budget, factor = args["budget"], args["peer_factor"]
    lines = [f"# time to quality ({report['created']}): byte-level LM over the stdlib source, "
             f"batch {args['batch']} per rank, T = {budget:g} s; {report['total_seconds'] / 60:.1f} min in all"]
    for command in report.get("commands", []):
        lines.append(f"command: `{command}`")
    if report.get("load"):
        lines.append("load (uptime, 1/5/15 min) before each setting: "
                     + "; ".join(f"{s}: {v}" for s, v in report["load"].items()))
    for setting, summary in report["summary"].items():
        ref = summary["_reference"]
        peer = ref[f"{LONG_PEER}_loss"]
        world = ref.get("world")
        local = ref["local"]
        lines += [f"\n## {setting}",
                  f"best loss ddp reaches in T: {_f(ref['ddp_best_loss_in_T'])}; {LONG_PEER}: "
                  f"{_f(peer.get('T'))} at T, {_f(peer.get('3T'))} at 3T, {_f(peer.get('last'))} at {factor:g}T"]
        if local:
            lines.append(f"local (1 process, no exchange, {local['runs']} run(s) of {local['seconds']:.0f} s): "
                         f"{_spread(local['loss_T_runs'])} at T, {_spread(local['loss_last_runs'])} at its end; "
                         f"effective speedup = (time local needs to reach the arm's loss in T) / T, ideal {world}; "
                         "'fit': read off one monotone fit of every local point instead of each raw curve")
        if any(row.get("link_bytes") is not None for row in summary.values()):
            lines.append("link bytes: what crossed between the hosts, measured on the links (Ethernet, IP and TCP "
                         "headers included): over the whole arm, start-up (the first broadcast of the weights) "
                         "included, and over its training in brackets; per step: the training's over rank 0's steps")
        lines += [f"| arm | loss in T | effective speedup (ideal {world}) | fit | time to ddp's best (s) "
                  f"| steps (rank 0) | samples/s (x local) | steps/s (x local) | ≤ {LONG_PEER} at 3T "
                  f"| ≤ at {factor:g}T | peak bytes/exchange | link bytes: arm (training) | link bytes/step "
                  "| same weights on every rank |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        if local:
            lines.append(f"| local (1 process, no exchange) | {_spread(local['loss_T_runs'])} | 1 (by definition) "
                         "| - | - | - "
                         f"| {local['samples_per_s']:.1f} | {local['steps_per_s']:.2f} | - | - | - | - | - | - |")
        for arm, row in summary.items():
            if arm.startswith("_"):
                continue
            if row["status"] != "ok":
                lines.append(f"| {arm} | {row['status']}: {row['reason']} | | | | | | | | | | | | |")
                continue
            reached = "-" if ref["ddp_best_loss_in_T"] is None else _f(row["time_to_ddp_best"], "{:.1f}", "not reached")
            failed = f" ({row['failed_runs']} run(s) failed)" if row.get("failed_runs") else ""
            lines.append(
                f"| {arm} | {_spread(row.get('loss_T_runs')) if row.get('loss_T_runs') else _f(row['loss_T'])}{failed} "
                f"| {_speedup(row)} | {_speedup(row, 'speedup_fit')} | {reached} | {row['steps']} "
                f"| {row['samples_per_s']:.1f} ({_f(row.get('samples_vs_local'), '{:.2f}x')}) "
                f"| {row['steps_per_s']:.2f} ({_f(row.get('steps_vs_local'), '{:.2f}x')}) "
                f"| {_yes(row.get(f'le_{LONG_PEER}_3T'))} | {_yes(row.get(f'le_{LONG_PEER}_last'))} "
                f"| {_bytes(row['peak_exchange_bytes'])} | {_link(row)} | {_bytes(row.get('link_bytes_per_step'))} "
                f"| {_yes(row['same_weights'])} |")
        for arm, row in summary.items():
            for note in row.get("notes") or []:
                lines.append(f"- {arm} (first run): {note}")
        peers = ref.get("peer_speedup") or {}
        ours = [a for a, row in summary.items() if not a.startswith("_") and row.get("vs_peers")]
        if peers and ours:
            lines += ["", "effective speedup of each arm over each peer's (a ratio is at most W / the peer's own "
                      "speedup, the bound in the header)",
                      "| arm | " + " | ".join(f"x {p} (≤ {_f(ref['peer_bound'][p], '{:.1f}')})" for p in peers) + " |",
                      "|---|" + "---|" * len(peers)]
            for arm in ours:
                lower = "≥ " if summary[arm].get("speedup_lower_bound") else ""
                lines.append(f"| {arm} | " + " | ".join(
                    _f(summary[arm]["vs_peers"][p], lower + "{:.2f}") for p in peers) + " |")
    return "\n".join(lines)


def plot(report: dict, setting: str, path: Path) -> None:
    """One PNG: held-out loss against wall time for every arm of ``setting`` (first runs, and
    ``local``), and beside it each arm's effective speedup (mean, min-max bars) against the ideal W."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    budget, factor = report["args"]["budget"], report["args"]["peer_factor"]
    summary = report.get("summary", {}).get(setting, {})
    bars = [(a, row) for a, row in summary.items() if not a.startswith("_") and row.get("speedup_runs")]
    fig, axes = plt.subplots(1, 2 if bars else 1, figsize=(15 if bars else 9, 5.5),
                             gridspec_kw={"width_ratios": [3, 2]} if bars else None, squeeze=False)
    ax = axes[0][0]
    arms = dict(report["settings"][setting])
    if report.get("local") and report["local"]["status"] == "ok":
        arms = {"local": report["local"], **arms}
    palette = plt.get_cmap("tab20").colors  # 13 arms: the default 10-colour cycle would repeat colours
    colours = {}
    for index, (arm, r) in enumerate(arms.items()):
        if r["status"] != "ok":
            continue
        t, loss = zip(*points(r))
        colour = palette[index % len(palette)]
        style = {"local": ("k", ":"), "ddp": ("k", "-")}.get(arm, (colour, "--" if arm.startswith("ddp") else "-"))
        colours[arm] = style[0]
        ax.plot(t, loss, linestyle=style[1], color=style[0], marker=".", label=arm)
    for k in sorted({1, 3, factor}):
        if k <= factor:
            ax.axvline(k * budget, color="grey", lw=0.6, ls=":")
    ax.set(title=f"time to quality, {setting} (T = {budget:g} s)", xlabel="wall time since the first step (s)",
           ylabel="held-out loss (nats/byte)")
    ax.legend(fontsize=7, ncol=2)
    if bars:
        ax = axes[0][1]
        means = [row["speedup_runs"]["mean"] for _, row in bars]
        low = [m - row["speedup_runs"]["min"] for m, (_, row) in zip(means, bars, strict=True)]
        high = [row["speedup_runs"]["max"] - m for m, (_, row) in zip(means, bars, strict=True)]
        ax.barh(range(len(bars)), means, xerr=[low, high], color=[colours.get(a, "grey") for a, _ in bars],
                capsize=3)
        labels = [f"{a} ({row['speedup_runs']['n']})" + (" ≥" if row.get("speedup_lower_bound") else "")
                  for a, row in bars]
        ax.set_yticks(range(len(bars)), labels, fontsize=7)
        ax.invert_yaxis()
        world = summary["_reference"].get("world")
        if world:
            ax.axvline(world, color="k", lw=1, ls="--", label=f"ideal W = {world}")
            ax.axvline(1, color="grey", lw=0.8, ls=":", label="one process")
            ax.legend(fontsize=7)
        ax.set(title="effective speedup (mean, min-max; runs)", xlabel="time one process needs for the loss in T / T")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rebuild(path: Path, add: list[Path] = ()) -> str:
    """Summary, markdown and plots of a saved report again (after a change to this module), with
    the runs of the reports ``add`` names added (``time_to_quality.merge_reports``; the same T,
    batch and task)."""
    import json

    from benchmarks.time_to_quality import merge_reports

    report = json.loads(path.read_text())
    for other_path in add:
        other = json.loads(other_path.read_text())
        for key in ("budget", "batch"):
            if other["args"][key] != report["args"][key] or other["task"] != report["task"]:
                raise SystemExit(f"{other_path}: {key}={other['args'][key]!r} or its task differs from {path}'s")
        other.setdefault("local_runs", [other["local"]] if other.get("local") else [])
        other.setdefault("repeats", {})
        other.setdefault("commands", [f"(the runs of {other_path}, created {other['created']})"])
        other.setdefault("load", {})
        report = merge_reports(report, other)
    args = report["args"]
    local_runs = report.get("local_runs") or ([report["local"]] if report.get("local") else [])
    report["local"] = local_runs[0] if local_runs else None
    report["summary"] = {s: summarize(r, report["local"], args["budget"], args["peer_factor"],
                                      report.get("repeats", {}).get(s), local_runs)
                         for s, r in report["settings"].items()}
    path.write_text(json.dumps(report, indent=1))
    text = markdown(report)
    path.with_suffix(".md").write_text(text + "\n")
    for setting in report["settings"]:
        plot(report, setting, path.with_name(f"{path.stem}_{setting.replace(':', '_')}.png"))
    return text


if __name__ == "__main__":
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description="rebuild the tables and plots of a time-to-quality report")
    parser.add_argument("report", type=Path, help="a result JSON of benchmarks/time_to_quality.py (rewritten)")
    parser.add_argument("--add", type=Path, nargs="+", default=[], help="other reports whose runs to add to it")
    ns = parser.parse_args()
    print(rebuild(ns.report, ns.add))
