"""mpi_auto and period="auto" through the Trainer on 2 ranks: it trains, the ranks agree on every
choice, a forced switch (assumed measurements) keeps every rank on the same weights, and
checkpoints resume exactly (the decision itself: tests/rules/test_auto_choice.py)."""
from __future__ import annotations

import json

import pytest

from lightning_mpi.rules.auto import AutoRule
from tests.mpi_utils import REPO, run_mpi

SCRIPTS = REPO / "tests" / "scripts"


def test_mpi_auto_is_registered_with_its_own_class():
    import lightning_mpi

    assert lightning_mpi.STRATEGIES["mpi_auto"][0] == "AutoStrategy"
    strategy = lightning_mpi.AutoStrategy(measure_every=50, tolerance=0.2)
    assert isinstance(strategy.rule, AutoRule) and strategy.rule.measure_every == 50
    with pytest.raises(ValueError, match="tolerance="):
        lightning_mpi.AutoStrategy(tolerance=0.0)
    assert lightning_mpi.DiLoCoStrategy(period="auto").rule.period == "auto"


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_mpi_auto_on_two_ranks(tmp_path):
    out = tmp_path / "out.json"
    run_mpi(2, [str(SCRIPTS / "auto_train.py"), str(out)], timeout=240, cwd=tmp_path)
    r = json.loads(out.read_text())
    # (a) forced: Streaming DiLoCo at its defaults, sync after step 5, streaming after 9, sync after 13; ranks agree on
    # every arm; under sync (and right after each switch into it) every rank holds the same weights
    steps = r["switches"]["steps"]
    assert [s["arm"] for s in steps] == ["streaming"] * 4 + ["sync"] * 4 + ["streaming"] * 4 + ["sync"] * 4
    assert all(s["arms_agree"] for s in steps)
    assert all(s["identical"] for s in steps if s["arm"] == "sync")
    assert r["switches"]["switches"] == 3 and r["switches"]["identical_end"]
    # (b) exact resume, saved while Streaming DiLoCo ran; the resumed run switches back at step 13
    resume = r["resume_auto"]
    assert resume["equal_on_every_rank"] and resume["identical"], resume
    assert resume["saved"]["arm"] == "streaming" and resume["arms_after"] == ["streaming"] * 2 + ["sync"] * 8
    # (c) real measurements: trains, agrees, logs the link
    measured = r["measured"]
    assert measured["arms_agree"] and measured["identical_end"] and measured["finite"] and measured["has_link"]
    assert measured["decisions"] == 2
    # (d) period="auto" resumes with the period it chose
    diloco = r["resume_diloco_auto"]
    assert diloco["equal_on_every_rank"] and diloco["identical"] and diloco["saved"]["period"] >= 8, diloco


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_mpi_auto_per_level_on_two_hosts_of_two_ranks(tmp_path):
    """Forced fast, slow, fast on 2 hosts of 2 ranks (faked): every step over all ranks, then two levels
    (every step inside each host: its ranks hold the same weights, the hosts differ), then every step again
    (the switch averages the hosts)."""
    out = tmp_path / "levels.json"
    run_mpi(4, [str(SCRIPTS / "auto_train.py"), str(out), "levels"], timeout=180, cwd=tmp_path)
    r = json.loads(out.read_text())
    steps = r["steps"]
    assert [s["arm"] for s in steps] == ["streaming"] * 4 + ["sync"] * 6 + ["hybrid"] * 6 + ["sync"] * 4
    assert all(s["arms_agree"] and s["identical_in_hosts"] for s in steps[4:])
    assert not any(s["identical"] for s in steps[11:16])  # the hosts step apart between outer exchanges
    assert all(s["identical"] for s in steps if s["arm"] == "sync")
    assert r["switches"] == 3 and r["identical_end"]
