"""How fast the survivors of a killed rank go on: kill -> detection -> healed -> next collective.

    python benchmarks/heal_latency.py [--runs 3]       # from the Open MPI environment (ULFM)

Runs ``lightning-mpi --heal -n 3 tests/scripts/ulfm_heal.py`` ``--runs`` times. In each run a
rank is SIGKILLed three times: in a blocking Allreduce loop, in an Iallreduce polled with Test,
and while a one-sided window is used with a progress thread (tests/comm/test_ulfm.py checks the
sums; this script reads the timings). Prints, per phase, the median over runs and survivors of:

- detect: from the kill to the survivor's ``ProcessFailed``;
- heal: :func:`lightning_mpi.comm.healing.heal_run` (revoke, shrink, agree, new transport);
- next collective: from the kill to the first collective completed on the healed communicator;
- replaced: from the kill to the first step completed with a spawned replacement (the phases
  that respawn; the replacement runs the script, so this includes its Python and torch imports).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run() -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "lightning_mpi",
            "-n",
            "3",
            "--heal",
            "--grace",
            "3",
            str(REPO / "tests" / "scripts" / "ulfm_heal.py"),
            out,
        ]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise SystemExit(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
        kills = {p.suffix[1:]: float(p.read_text()) for p in Path(out).glob("kill.*")}
        rows = []
        for result in Path(out).glob("out.*.json"):
            for event in json.loads(result.read_text())["events"]:
                kill = kills[event["phase"]]
                rows.append(
                    {
                        "phase": event["phase"],
                        "detect": event["detected_at"] - kill,
                        "heal": event["heal_seconds"],
                        "next collective": event["healed_collective_at"] - kill,
                        "replaced": event["next_step_at"] - kill if "respawned_at" in event else None,
                    }
                )
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows = [row for _ in range(args.runs) for row in one_run()]
    print(
        f"| phase (W = 3, one rank SIGKILLed) | detect ms | heal ms | next collective ms | replaced s |"
        f"  (median of {args.runs} runs x 2 survivors)"
    )
    print("|---|---|---|---|---|")
    for phase in ("allreduce", "iallreduce", "window"):
        mine = [r for r in rows if r["phase"] == phase]
        med = {k: statistics.median(r[k] for r in mine) for k in ("detect", "heal", "next collective")}
        replaced = [r["replaced"] for r in mine if r["replaced"] is not None]
        replaced_s = f"{statistics.median(replaced):.1f}" if replaced else "-"
        print(
            f"| {phase} | {med['detect'] * 1e3:.0f} | {med['heal'] * 1e3:.1f} | {med['next collective'] * 1e3:.0f} | "
            f"{replaced_s} |"
        )


if __name__ == "__main__":
    main()
