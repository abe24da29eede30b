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
- ``same_weights``: every rank ends with bit-identical weights.
"""
from __future__ import annotations

from pathlib import Path

LONG_PEER = "ddp_fp16"


def points(r: dict) -> list[tuple[float, float]]:
    """(seconds, held-out loss) of an arm's curve, ending with the final weights."""
    return [(p["t"], p["loss"]) for p in r["curve"]] + [(r["seconds"], r["final_loss"])]


def loss_at(r: dict, t: float) -> float | None:
    """The first point at or after ``t`` (the snapshot taken when the clock passed ``t``)."""
    later = [loss for s, loss in points(r) if s >= t - 1e-9]
    return later[0] if later else None


def summarize(results: dict[str, dict], local: dict | None, budget: float, peer_factor: float) -> dict[str, dict]:
    ok = {a: r for a, r in results.items() if r["status"] == "ok"}
    ddp = ok.get("ddp")
    ddp_best = min(loss for t, loss in points(ddp)) if ddp else None
    peer = ok.get(LONG_PEER)
    peer_losses = {"T": loss_at(peer, budget), "3T": loss_at(peer, 3 * budget), "last": peer["final_loss"]} if peer else {}
    local_ok = local if local and local.get("status") == "ok" else None
    summary = {}
    for arm, r in results.items():
        if r["status"] != "ok":
            summary[arm] = {"status": r["status"], "reason": r.get("reason", "")}
            continue
        loss_T = loss_at(r, budget) if arm == LONG_PEER else r["final_loss"]
        reached = [t for t, loss in points(r) if ddp_best is not None and loss <= ddp_best]
        sps, steps_ps = r["samples"] / r["seconds"], r["steps"] / r["seconds"]
        row = {"status": "ok", "loss_T": loss_T, "time_to_ddp_best": reached[0] if reached else None,
               "samples_per_s": sps, "steps_per_s": steps_ps, "steps": r["steps"], "world": r["world"],
               "peak_exchange_bytes": r.get("peak_exchange_bytes"), "same_weights": r.get("same_weights")}
        if local_ok:
            row["samples_vs_local"] = sps / (local_ok["samples"] / local_ok["seconds"])
            row["steps_vs_local"] = steps_ps / (local_ok["steps"] / local_ok["seconds"])
        for key, value in peer_losses.items():
            comparable = arm != LONG_PEER and value is not None and loss_T is not None
            row[f"le_{LONG_PEER}_{key}"] = (loss_T <= value) if comparable else None
        summary[arm] = row
    summary["_reference"] = {"ddp_best_loss_in_T": ddp_best, f"{LONG_PEER}_loss": peer_losses,
                             "local": {"loss_T": local_ok["final_loss"], "samples_per_s": local_ok["samples"] / local_ok["seconds"],
                                       "steps_per_s": local_ok["steps"] / local_ok["seconds"]} if local_ok else None}
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


def _yes(value) -> str:
    return "-" if value is None else ("yes" if value else "**no**")


def markdown(report: dict) -> str:
    args = report["args"]
    budget, factor = args["budget"], args["peer_factor"]
    lines = [f"# time to quality ({report['created']}): byte-level LM over the stdlib source, "
             f"batch {args['batch']} per rank, T = {budget:g} s; {report['total_seconds'] / 60:.1f} min in all"]
    for setting, summary in report["summary"].items():
        ref = summary["_reference"]
        peer = ref[f"{LONG_PEER}_loss"]
        lines += [f"\n## {setting}",
                  f"best loss ddp reaches in T: {_f(ref['ddp_best_loss_in_T'])}; {LONG_PEER}: "
                  f"{_f(peer.get('T'))} at T, {_f(peer.get('3T'))} at 3T, {_f(peer.get('last'))} at {factor:g}T",
                  f"| arm | loss in T | time to ddp's best (s) | steps (rank 0) | samples/s (x local) | steps/s (x local) "
                  f"| ≤ {LONG_PEER} at 3T | ≤ at {factor:g}T | peak bytes/exchange | same weights on every rank |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        local = ref["local"]
        if local:
            lines.append(f"| local (1 process, no exchange) | {local['loss_T']:.3f} | - | - | {local['samples_per_s']:.1f} "
                         f"| {local['steps_per_s']:.2f} | - | - | - | - |")
        for arm, row in summary.items():
            if arm.startswith("_"):
                continue
            if row["status"] != "ok":
                lines.append(f"| {arm} | {row['status']}: {row['reason']} | | | | | | | | |")
                continue
            reached = "-" if ref["ddp_best_loss_in_T"] is None else _f(row["time_to_ddp_best"], "{:.1f}", "not reached")
            lines.append(
                f"| {arm} | {_f(row['loss_T'])} | {reached} | {row['steps']} "
                f"| {row['samples_per_s']:.1f} ({_f(row.get('samples_vs_local'), '{:.2f}x')}) "
                f"| {row['steps_per_s']:.2f} ({_f(row.get('steps_vs_local'), '{:.2f}x')}) "
                f"| {_yes(row.get(f'le_{LONG_PEER}_3T'))} | {_yes(row.get(f'le_{LONG_PEER}_last'))} "
                f"| {_bytes(row['peak_exchange_bytes'])} | {_yes(row['same_weights'])} |")
    return "\n".join(lines)


def plot(report: dict, setting: str, path: Path) -> None:
    """Held-out loss against wall time, every arm of ``setting`` (and ``local``), one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    budget, factor = report["args"]["budget"], report["args"]["peer_factor"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    arms = dict(report["settings"][setting])
    if report.get("local") and report["local"]["status"] == "ok":
        arms = {"local": report["local"], **arms}
    palette = plt.get_cmap("tab20").colors  # 13 arms: the default 10-colour cycle would repeat colours
    for index, (arm, r) in enumerate(arms.items()):
        if r["status"] != "ok":
            continue
        t, loss = zip(*points(r))
        colour = palette[index % len(palette)]
        style = {"local": ("k", ":"), "ddp": ("k", "-")}.get(arm, (colour, "--" if arm.startswith("ddp") else "-"))
        ax.plot(t, loss, linestyle=style[1], color=style[0], marker=".", label=arm)
    for k in sorted({1, 3, factor}):
        if k <= factor:
            ax.axvline(k * budget, color="grey", lw=0.6, ls=":")
    ax.set(title=f"time to quality, {setting} (T = {budget:g} s)", xlabel="wall time since the first step (s)",
           ylabel="held-out loss (nats/byte)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
