"""The link model and period="auto" (lightning_mpi.rules.link.model, .diloco.outer.averages_at, the rules'
options): pure functions against hand computation, and DiLoCo choosing its period on one rank."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_mpi.rules.diloco import DiLoCoRule, StreamingDiLoCoRule
from lightning_mpi.rules.diloco.outer import averages_at
from lightning_mpi.rules.diloco.period import AUTO_PROBE_STEPS
from lightning_mpi.rules.link import Link
from lightning_mpi.rules.link.model import exposed_seconds, fit_link, hidden_schedule
from tests.rules.test_diloco import _self_transport


def test_fit_link_reads_latency_from_the_tiny_exchange_and_bandwidth_from_the_extra_time():
    link = fit_link(4, 0.001, 1_000_004, 0.101)
    assert link.latency == 0.001 and link.bandwidth == pytest.approx(1e7)
    assert link.seconds(2e6) == pytest.approx(0.201)
    # noise: the big exchange no slower than the tiny one -> its extra bytes over its own time
    assert fit_link(4, 0.01, 1_000_004, 0.005).bandwidth == pytest.approx(1_000_000 / 0.005)
    assert math.isinf(fit_link(4, 0.001, 4, 0.001).bandwidth)


def test_blocking_period_keeps_the_exchange_under_a_tenth_of_the_steps():
    # 0.5 s exchange, 0.05 s steps: 10 steps of exchange -> H = 100 (10%)
    assert hidden_schedule(0.5, 0.05) == (100, 0)
    # fast link: the floor (the outer step overshoots with a handful of inner steps)
    assert hidden_schedule(1e-4, 0.05) == (8, 0)
    # slow link: the ceiling
    assert hidden_schedule(100.0, 0.05) == (500, 0)
    assert hidden_schedule(math.inf, 0.05) == (500, 0)


def test_overlapped_period_raises_tau_until_one_fragment_hides_and_keeps_tau_below_h_over_p():
    # one fragment's exchange takes 2.5 steps: τ = 3; the link at most half busy: H ≥ 4 · 2.5 / 0.5 = 20
    assert hidden_schedule(0.25, 0.1, fragments=4, overlap_steps=1) == (20, 3)
    assert hidden_schedule(0.25, 0.1, fragments=4, overlap_steps=1, link_share=1.0) == (16, 3)
    # a fast link keeps the user's τ; the floor min_period, rounded to a multiple of P
    assert hidden_schedule(1e-3, 0.1, fragments=3, overlap_steps=1) == (9, 1)
    period, tau = hidden_schedule(0.25, 0.1, fragments=4, overlap_steps=1)
    assert tau < period // 4 and period % 4 == 0
    with pytest.raises(ValueError, match="step_seconds="):
        hidden_schedule(1.0, 0.0)


def test_exposed_seconds():
    assert exposed_seconds(0.3, 0.2) == pytest.approx(0.1) and exposed_seconds(0.1, 0.2) == 0.0
    assert Link(1e6, 0.0).seconds(1e6) == 1.0


def test_outer_warmup_averages_the_first_outer_steps():
    assert [averages_at(k, 2) for k in (1, 2, 3, 9)] == [True, True, False, False]
    assert not averages_at(1, 0)


@pytest.mark.parametrize("make, kwargs, name", [
    (DiLoCoRule, {"period": "fast"}, "period"),
    (DiLoCoRule, {"period": 0}, "period"),
    (DiLoCoRule, {"outer_warmup": -1}, "outer_warmup"),
])
def test_bad_auto_options_name_themselves(make, kwargs, name):
    with pytest.raises(ValueError, match=rf"{name}="):
        make(**kwargs)


def _train(rule, steps, seed=0):
    torch.manual_seed(seed)
    net = nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    bound = rule.bind(_self_transport(), list(net.parameters()))
    bound.on_train_start()
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(8, 4)).pow(2).mean().backward()
        bound.before_step(opt)
        opt.step()
        bound.after_step(opt)
    return bound, net


@pytest.mark.parametrize("rule", [DiLoCoRule(period="auto"), StreamingDiLoCoRule(period="auto", fragments=2)])
def test_auto_period_is_chosen_after_the_probe_steps_and_saved(rule):
    bound, _ = _train(rule, AUTO_PROBE_STEPS)
    assert bound.period is None
    bound, _ = _train(rule, AUTO_PROBE_STEPS + 1)
    assert bound.period is not None and bound.period >= 8 and bound.offsets[-1] == AUTO_PROBE_STEPS + 1 + bound.period
    state = bound.state_dict()
    assert state["schedule"]["period"] == bound.period
    fresh = rule.bind(bound.transport, bound.params)
    fresh.load_state_dict(state)
    assert (fresh.period, fresh.offsets, fresh.overlap_steps) == (bound.period, bound.offsets, bound.overlap_steps)
    bound.on_train_end()
    assert bound.stats()["period"] == bound.period


def test_auto_period_run_shorter_than_the_probe_still_folds_in_its_steps():
    bound, net = _train(DiLoCoRule(period="auto", outer_momentum=0.0, outer_lr=1.0), 2)
    before = [p.detach().clone() for p in net.parameters()]
    bound.on_train_end()
    assert bound.outer_steps == 1
    # one rank: θ_global ends where the rank's own weights were
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(before, net.parameters(), strict=True))
