"""mpi_auto's decision (lightning_mpi.rules.auto.choice) and options (lightning_mpi.rules.auto.rule): link and
compute -> arm, hysteresis, observed costs, and bad input. The rule on ranks: tests/strategies/test_auto.py."""
from __future__ import annotations

import pytest

from lightning_mpi.comm.codecs import get_codec
from lightning_mpi.rules.auto import AutoRule
from lightning_mpi.comm.sparseloco import SparseLoCoWire
from lightning_mpi.rules.auto.choice import (
    SPARSE_WHEN,
    Choice,
    Sizes,
    choose,
    default_plan,
    dry_run_exposed,
    hybrid_plan,
    inner_hides,
    powersgd_bytes,
    streaming_plan,
    worth_timing,
)
from lightning_mpi.rules.diloco.fragments import exchange_bytes
from lightning_mpi.rules.link import Link
from lightning_mpi.rules.link.model import hidden_schedule
from tests.scripts.auto_assumed import parse_assumed

#: the time-to-quality task's model on 2 ranks: 17M values, PowerSGD rank 1 sends ~85 kB
MODEL = Sizes(numel=17_000_000, tensors=10, powersgd_bytes=85_000, world=2)
STEP = 0.08  # seconds of compute per step


def mbit(rate, latency_ms=0.1):
    return Link(rate * 1e6 / 8, latency_ms / 1e3)


@pytest.mark.parametrize("rate, arm", [(10_000, "sync"), (1_000, "powersgd"), (10, "streaming")])
def test_the_link_picks_the_arm(rate, arm):
    choice, why = choose(STEP, mbit(rate), MODEL)
    assert choice.arm == arm, why


def test_streaming_gets_its_defaults_with_the_period_raised_where_the_exchange_needs_it():
    # mpi_streaming_diloco's defaults (int4, 4 fragments, τ 1, period 50); where the largest
    # fragment's exchange needs more steps, its own period="auto" raises τ and the period past 50,
    # and that plan is taken; past twice the default period, SparseLoCo's wire with its own schedule
    sizes = Sizes.of([(4000, 4000), (4000,), (500, 500), (1000, 1000), (10,)], world=2)
    assert default_plan(sizes) == Choice("streaming", "int4", 4, 50, 1)
    largest = 16_000_000  # the first fragment holds the 4000 x 4000 matrix alone (split_fragments)
    wires = {}
    for rate in (10, 40, 100):
        choice = streaming_plan(STEP, mbit(rate), sizes)
        dense = hidden_schedule(mbit(rate).seconds(exchange_bytes(largest, 2, get_codec("int4"))), STEP, 4, 1)
        sparse_bytes = exchange_bytes(largest, 2, SparseLoCoWire(), [largest])
        sparse = hidden_schedule(mbit(rate).seconds(sparse_bytes), STEP, 4, 1)
        wires[rate] = choice.wire
        assert choice.fragments == 4 and choice.overlap_steps < choice.period // choice.fragments
        if dense[0] > SPARSE_WHEN * 50:
            assert (choice.wire, choice.period, choice.overlap_steps) == ("sparseloco", *sparse), rate
        else:
            assert (choice.wire, choice.period, choice.overlap_steps) == ("int4", *dense), rate
            assert choice.period > 50
    assert wires[10] == "sparseloco" and "int4" in wires.values(), wires
    assert choose(STEP, mbit(10), sizes)[0] == streaming_plan(STEP, mbit(10), sizes)  # the plan is taken
    assert sparse_bytes * 16 < exchange_bytes(largest, 2, get_codec("int4"))
    # a faster link: period="auto" would pick 8; the default 50 is kept (every exchange costs CPU)
    assert hidden_schedule(mbit(1_000).seconds(exchange_bytes(largest, 2, get_codec("int4"))), STEP, 4, 1)[0] == 8
    assert streaming_plan(STEP, mbit(1_000), sizes) == default_plan(sizes)
    # the task's model at 100 Mbit/s: a quarter of it (2.1 MB) needs 3 steps; the default period, τ 3
    assert streaming_plan(STEP, mbit(100), MODEL) == Choice("streaming", "int4", 4, 50, 3)
    # fewer tensors than the default's fragments: one fragment per tensor, as the rule binds
    assert streaming_plan(STEP, mbit(10), Sizes.of([(100, 50), (100,)], world=2)).fragments == 2


def test_per_level_every_step_inside_hosts_and_streaming_across_where_the_link_between_them_calls_for_it():
    # 2 hosts x 2 ranks of the task's model; the link measured is the slowest, between the hosts
    shapes = [(4000, 4000), (4000,), (500, 500), (1000, 1000), (10,)]
    two = Sizes.of(shapes, world=4, hosts=[0, 0, 1, 1])
    assert (two.hosts, two.per_host, two.two_levels) == (2, 2, True)
    assert not Sizes.of(shapes, world=4).two_levels and not Sizes.of(shapes, world=4, hosts=[0, 0, 0, 0]).two_levels
    assert Sizes.of(shapes, world=3, hosts=[0, 0, 1]).two_levels  # uneven hosts: the largest decides the pieces
    # a fast link: every step over all ranks, whatever the hosts
    assert choose(STEP, mbit(10_000), two)[0].arm == "sync"
    # a slow one: two levels (inside not timed: a host's shared memory is taken to hide), and the plan of the
    # rank's piece: half of the largest fragment, averaged with the one carrier of the other host
    choice, why = choose(STEP, mbit(10), two, first=True)
    assert choice == hybrid_plan(STEP, mbit(10), two) and choice.arm == "hybrid", why
    assert "every step inside each host (not timed" in why
    assert two.piece_bytes("int4", 4) * 2 <= exchange_bytes(16_000_000, 2, get_codec("int4")) + 64
    flat = streaming_plan(STEP, mbit(10), Sizes.of(shapes, world=4))
    plan = hybrid_plan(STEP, mbit(10), two)
    assert plan.period <= flat.period  # each rank's piece hides sooner than a flat worker's whole fragment
    assert "two levels" in plan.describe() and plan.describe().endswith(f"period={plan.period}, overlap_steps="
                                                                         f"{plan.overlap_steps})")
    # the exchange inside the hosts timed: hides -> two levels; exposes more than the tolerance -> flat streaming
    assert choose(STEP, mbit(10), two, observed={"inner": 0.0}, first=True)[0].arm == "hybrid"
    choice, why = choose(STEP, mbit(10), two, observed={"inner": 0.5 * STEP}, first=True)
    assert choice.arm == "streaming" and "inside each host" not in why
    # hysteresis: two levels in use are kept while the inner exposes up to tolerance x KEEP; entered at x ENTER
    assert inner_hides(STEP, two, plan, {"inner": 0.15 * STEP}, 0.1) is not None
    assert inner_hides(STEP, two, flat, {"inner": 0.08 * STEP}, 0.1) is None
    assert inner_hides(STEP, two, flat, {"inner": 0.04 * STEP}, 0.1) is not None
    # one host, or one rank per host: no inner level
    assert inner_hides(STEP, Sizes.of(shapes, world=4, hosts=[0, 0, 0, 0]), None, {}, 0.1) is None
    assert choose(STEP, mbit(10), Sizes.of(shapes, world=4), first=True)[0].arm == "streaming"


def test_the_first_decision_takes_the_streaming_plan_as_computed_and_later_ones_keep_a_close_one():
    start = default_plan(MODEL)
    # 100 Mbit/s: the plan differs from the defaults' only in τ: the first decision takes it (the
    # arm reschedules in place before its first exchange), a later one keeps the plan in use
    observed = {"powersgd": 0.6 * STEP}
    taken, _ = choose(STEP, mbit(100), MODEL, current=start, observed=observed, first=True)
    assert taken == streaming_plan(STEP, mbit(100), MODEL) and taken.overlap_steps > start.overlap_steps
    assert (taken.wire, taken.fragments, taken.period) == (start.wire, start.fragments, start.period)
    kept, why = choose(STEP, mbit(100), MODEL, current=start, observed=observed)
    assert kept == start and "close to the new one" in why
    # a fast link with a cheap every-step arm: entered at the tolerance (no hysteresis yet)
    fast = {"sync": 0.08 * STEP, "powersgd": 0.5 * STEP}
    assert choose(STEP, mbit(10_000), MODEL, current=start, observed=fast, first=True)[0].arm == "sync"
    assert choose(STEP, mbit(10_000), MODEL, current=start, observed=fast)[0] == start  # later: < 5% needed


def test_a_dry_run_that_costs_more_than_the_link_says_sends_the_first_decision_to_streaming():
    # PowerSGD at 1 Gbit/s: the link predicts 1% of a step; its dry run took 60% of one
    # (matrix products and orthogonalisation on 2 cores), and its link part hides behind backward
    link = mbit(1_000)
    assert worth_timing("powersgd", STEP, link, MODEL, 0.1) and not worth_timing("sync", STEP, link, MODEL, 0.1)
    exposed = dry_run_exposed("powersgd", 0.6 * STEP, STEP, link, MODEL)
    assert exposed == pytest.approx(0.6 * STEP - link.latency - link.seconds(85_000))
    choice, why = choose(STEP, link, MODEL, observed={"powersgd": exposed})
    assert choice.arm == "streaming" and "powersgd 59% (observed)" in why
    assert choice == streaming_plan(STEP, link, MODEL)
    # a cheap one is taken
    assert choose(STEP, link, MODEL, observed={"powersgd": 0.02 * STEP})[0].arm == "powersgd"


def test_on_shared_memory_slow_every_step_exchanges_lose_to_streaming():
    # shared memory: the link hides everything, but the fp16 casts and sums took 120% of a step and
    # PowerSGD 65%; only the link part (here ~nothing) hides behind backward
    link = mbit(100_000, latency_ms=0.01)
    assert worth_timing("sync", STEP, link, MODEL, 0.1) and worth_timing("powersgd", STEP, link, MODEL, 0.1)
    observed = {arm: dry_run_exposed(arm, share * STEP, STEP, link, MODEL) for arm, share in [("sync", 1.2), ("powersgd", 0.65)]}
    assert observed["sync"] > 1.1 * STEP
    choice, why = choose(STEP, link, MODEL, observed=observed)
    assert choice.arm == "streaming", why
    # where the ASA exchange is mostly link time (10 Gbit/s), backward hides it
    fast = mbit(10_000)
    hidden = dry_run_exposed("sync", fast.seconds(MODEL.sync_bytes()) + 0.005, STEP, fast, MODEL)
    assert hidden == pytest.approx(0.005) and choose(STEP, fast, MODEL, observed={"sync": hidden})[0].arm == "sync"
    with pytest.raises(ValueError, match="arm="):
        dry_run_exposed("streaming", 1.0, STEP, link, MODEL)


def test_hysteresis_keeps_the_arm_in_use_inside_the_band_and_enters_only_well_below():
    sync = Choice("sync", "fp16")
    # sync observed at 15% of a step: not enough to enter (10%), enough to keep (20%)
    kept, why = choose(STEP, mbit(10_000), MODEL, current=sync, observed={"sync": 0.15 * STEP})
    assert kept == sync, why
    first, _ = choose(STEP, mbit(10_000), MODEL, observed={"sync": 0.15 * STEP})
    assert first.arm == "powersgd"
    # past the band: leave it
    left, _ = choose(STEP, mbit(10_000), MODEL, current=sync, observed={"sync": 0.25 * STEP})
    assert left.arm == "powersgd"
    # from PowerSGD back to sync only when sync is predicted under half the tolerance
    psgd = Choice("powersgd")
    assert choose(STEP, mbit(10_000), MODEL, current=psgd)[0].arm == "sync"  # predicted 0%
    sync_at_7 = {"sync": 0.07 * STEP}
    assert choose(STEP, mbit(10_000), MODEL, current=psgd, observed=sync_at_7)[0] == psgd


def test_an_observed_cost_overrides_the_prediction():
    # PowerSGD's matrix products: predicted 1% at 1 Gbit/s, seen at 40%
    choice, why = choose(STEP, mbit(1_000), MODEL, current=Choice("powersgd"), observed={"powersgd": 0.4 * STEP})
    assert choice.arm == "streaming" and "(observed)" in why


def test_streaming_keeps_its_plan_unless_it_changes_clearly():
    plan = streaming_plan(STEP, mbit(10), MODEL)
    assert choose(STEP, mbit(11), MODEL, current=plan)[0] == plan  # a little faster: same plan
    faster = choose(STEP, mbit(60), MODEL, current=plan)[0]  # PowerSGD still 14%: streaming, retuned
    assert faster.arm == "streaming" and faster != plan


def test_choice_round_trip_and_sizes():
    choice = Choice("streaming", "int8", 4, 40, 2)
    assert Choice.from_dict(choice.as_dict()) == choice
    assert "period=40" in choice.describe()
    # a 100 x 50 matrix at rank 1: (100 + 50) values; a bias of 100 uncompressed; fp32, 2 (W-1)/W
    assert powersgd_bytes([(100, 50), (100,)], world=2) == (150 + 100) * 4
    sizes = Sizes.of([(100, 50), (100,)], world=3)
    assert sizes.numel == 5100 and sizes.tensors == 2
    assert choose(STEP, mbit(1), Sizes(10, 1, 40, 1))[0].arm == "sync"  # one rank


def test_assumed_measurements_and_bad_options_name_themselves():
    first, second = parse_assumed("50,1000,0.1; 20,100,1")
    assert first.step_seconds == 0.05 and first.link.bandwidth == 125e6 and second.link.latency == 0.001
    for bad in ("50,1000", "a,b,c", "50,0,1", ";"):
        with pytest.raises(ValueError, match="assume="):
            parse_assumed(bad)
    with pytest.raises(ValueError, match="tolerance="):
        AutoRule(tolerance=1.5)
    with pytest.raises(ValueError, match="measure_every="):
        AutoRule(measure_every=-1)


def test_on_one_rank_the_rule_is_a_plain_every_step_rule_and_round_trips():
    import torch
    from torch import nn

    from tests.rules.test_diloco import _self_transport

    net = nn.Linear(3, 2)
    bound = AutoRule().bind(_self_transport(), list(net.parameters()))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    bound.on_train_start()
    for _ in range(7):
        opt.zero_grad()
        net(torch.randn(4, 3)).sum().backward()
        assert bound.before_step(opt)
        opt.step()
        bound.after_step(opt)
    assert bound.choice.arm == "sync" and bound.decisions == 0 and bound.inner.skipped_steps == 0  # the arm's own
    bound.sync_enabled = False
    assert bound.inner.sync_enabled is False
    fresh = AutoRule().bind(_self_transport(), list(net.parameters()))
    fresh.load_state_dict(bound.state_dict())
    assert fresh.steps == 7 and fresh.choice == bound.choice
    bound.on_train_end()
    bound.close()
    fresh.close()


def test_a_decision_times_an_arm_again_only_where_the_link_moved_past_a_factor_2():
    """DecisionProbe.dry_runs on a stand-in transport: an arm timed on a link like this one keeps
    its observed cost (the dry runs cost mpi_auto steps at every decision); one whose link moved
    more than a factor 2 is timed again. Its inputs are agreed values, so every rank skips alike."""
    from types import SimpleNamespace

    from lightning_mpi.rules.auto.choice import still_valid
    from lightning_mpi.rules.auto.measure import DecisionProbe
    from lightning_mpi.rules.link import Measurement

    probe = DecisionProbe(SimpleNamespace(size=2, allreduce_=lambda t, op="sum": t), [], MODEL, tolerance=0.1)
    timed = []
    probe.sync_seconds = lambda: timed.append("sync") or 2.0 * STEP
    probe.powersgd_seconds = lambda: timed.append("powersgd") or 1.3 * STEP
    fast = mbit(10_000)
    observed: dict = {}
    probe.dry_runs(Measurement(STEP, fast), "streaming", observed)
    assert timed == ["sync", "powersgd"] and set(observed) == {"sync", "powersgd"}
    first = dict(observed)
    probe.dry_runs(Measurement(STEP, mbit(6_000)), "streaming", observed)  # within a factor 2: kept
    assert timed == ["sync", "powersgd"] and observed == first
    probe.dry_runs(Measurement(STEP, mbit(30_000)), "streaming", observed)  # moved past it: timed again
    assert timed == ["sync", "powersgd"] * 2 and observed["sync"][1] == mbit(30_000).bandwidth
    assert still_valid(100.0, 199.0) and still_valid(100.0, 51.0)
    assert not still_valid(100.0, 201.0) and not still_valid(100.0, 49.0)


def test_a_slow_link_is_probed_more_rarely_so_that_probing_costs_at_most_1_percent():
    from lightning_mpi.rules.auto.measure import PROBE_NUMEL, measure_interval, probe_seconds
    from lightning_mpi.rules.link import Measurement

    numel = MODEL.numel
    # 100 Mbit/s: the 1 MiB probe takes ~84 ms, under 0.25 s, so three runs: ~0.25 s in all
    slow = mbit(100)
    assert probe_seconds(slow, 2, numel) == pytest.approx(3 * slow.seconds(4.0) + 3 * slow.seconds(PROBE_NUMEL * 4))
    every = measure_interval(100, Measurement(0.067, slow), 2, numel)
    assert every > 300 and probe_seconds(slow, 2, numel) <= 0.01 * 0.067 * every
    # 1 Gbit/s and faster: the probe is cheap, measure_every stands; 0 still means "decide once"
    assert measure_interval(100, Measurement(0.067, mbit(1_000)), 2, numel) == 100
    assert measure_interval(100, Measurement(0.067, mbit(10_000)), 2, numel) == 100
    assert measure_interval(0, Measurement(0.067, slow), 2, numel) == 0
    # a probe under 10 ms never defers, however short the steps (a tiny model on shared memory)
    assert measure_interval(6, Measurement(0.0005, mbit(10_000, latency_ms=0.05)), 2, 1000) == 6
    # a probe that takes 0.25 s or more runs once; a small model's probe is smaller
    crawl = mbit(10)
    assert probe_seconds(crawl, 2, numel) == pytest.approx(3 * crawl.seconds(4.0) + crawl.seconds(PROBE_NUMEL * 4))
    assert probe_seconds(slow, 2, 1000) < probe_seconds(slow, 2, numel)
