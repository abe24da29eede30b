"""DiLoCo and Streaming DiLoCo rules (lightning_mpi.rules.diloco: .rule, .outer, .streaming, .fragments): the math
against hand computation, and the rules on one rank against a hand-written DiLoCo loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpi.comm.codecs import FP32, INT4, INT8, get_codec
from lightning_mpi.comm.collectives import encode_with_feedback_
from lightning_mpi.rules.diloco import DiLoCoRule, StreamingDiLoCoRule
from lightning_mpi.rules.diloco.fragments import OuterFragment, exchange_bytes
from lightning_mpi.rules.diloco.outer import (
    last_start,
    make_outer_optimizer,
    mix_,
    outer_step_,
    pseudo_gradient,
    starts_at,
)
from lightning_mpi.rules.diloco.streaming import fragment_offsets, split_fragments
from tests.mpi_utils import REPO

SCRIPTS = REPO / "tests" / "scripts"


# -- pure functions against hand math ------------------------------------------------------------
def test_outer_step_is_nesterov_sgd_on_the_pseudo_gradient():
    lr, mu = 0.7, 0.9
    theta = torch.tensor([1.0, -2.0, 3.0])
    opt = make_outer_optimizer([theta], lr, mu)
    d1, d2 = torch.tensor([0.5, 0.25, -1.0]), torch.tensor([-0.5, 1.0, 0.125])
    expected, buf = theta.clone(), torch.zeros(3)
    for delta in (d1, d2):
        outer_step_(opt, theta, delta.clone())
        buf = mu * buf + delta
        expected = expected - lr * (delta + mu * buf)
        assert torch.allclose(theta, expected, atol=1e-6)
        assert theta.grad is None


def test_outer_lr_one_without_momentum_is_the_average_of_the_replicas():
    theta_global = torch.tensor([1.0, 2.0])
    replicas = [torch.tensor([0.0, 3.0]), torch.tensor([4.0, 1.0]), torch.tensor([2.0, 2.0])]
    mean_delta = torch.stack([pseudo_gradient(theta_global, r) for r in replicas]).mean(0)
    outer_step_(make_outer_optimizer([theta_global], 1.0, 0.0), theta_global, mean_delta)
    assert torch.allclose(theta_global, torch.stack(replicas).mean(0))


def test_mix_keeps_alpha_of_the_local_weights():
    local, global_ = torch.tensor([2.0, 4.0]), torch.tensor([0.0, 8.0])
    assert torch.equal(mix_(local.clone(), global_, 0.25), torch.tensor([0.5, 7.0]))
    assert torch.equal(mix_(local.clone(), global_, 0.0), global_)


def test_fragment_schedule_staggers_one_exchange_every_period_over_fragments():
    period, fragments = 8, 4
    offsets = fragment_offsets(period, fragments)
    assert offsets == [2, 4, 6, 8]
    assert fragment_offsets(period, 1) == [period]  # one fragment: DiLoCo's steps H, 2H, ...
    for step in range(1, 33):
        due = [p for p, o in enumerate(offsets) if starts_at(step, o, period)]
        assert due == ([(step // 2 - 1) % fragments] if step % 2 == 0 else []), step
    assert [last_start(s, 2, 8) for s in (1, 2, 9, 10, 17)] == [0, 2, 2, 10, 10]
    assert fragment_offsets(10, 3) == [3, 6, 10]


def test_fragments_are_contiguous_nonempty_and_balanced():
    assert split_fragments([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert split_fragments([5, 5, 10, 1, 9], 2) == [0, 0, 1, 1, 1]
    skewed = split_fragments([100, 1, 1, 1], 3)
    assert skewed[0] == 0 and skewed[-1] == 2 and sorted(set(skewed)) == [0, 1, 2]
    assert all(0 <= b - a <= 1 for a, b in zip(skewed, skewed[1:]))
    with pytest.raises(ValueError, match="fragments=5"):
        split_fragments([1, 2, 3], 5)


@pytest.mark.parametrize("wire", ["fp32", "int8", "int4"])
def test_peak_bytes_per_exchange_are_a_fragment_of_diloco(wire):
    codec, world, fragments = get_codec(wire), 4, 4
    params = [p for layer in [nn.Linear(64, 64) for _ in range(4)] for p in layer.parameters()]
    groups = [
        [p for p, g in zip(params, split_fragments([p.numel() for p in params], fragments)) if g == k]
        for k in range(fragments)
    ]
    whole = OuterFragment(params, world, codec).bytes_per_exchange
    peak = max(OuterFragment(group, world, codec).bytes_per_exchange for group in groups)
    headers = 2 * (world - 1) * (codec.wire_numel(0) * torch.empty((), dtype=codec.wire_dtype).element_size())
    assert peak <= whole / fragments + headers  # a lossy row's 8-byte header is paid per exchange
    streaming_default = max(OuterFragment(group, world, INT4).bytes_per_exchange for group in groups)
    assert streaming_default <= OuterFragment(params, world, FP32).bytes_per_exchange / fragments / 7
    assert exchange_bytes(400, 1, codec) == 0
    assert exchange_bytes(400, 4, FP32) == 2 * 3 / 4 * 400 * 4


def test_int4_codec_quantizes_on_a_16_level_power_of_two_grid_with_exact_feedback():
    torch.manual_seed(0)
    for chunk in (1, 2, 7, 64):
        x = torch.randn(3, chunk)
        wire = torch.empty(3, INT4.wire_numel(chunk), dtype=torch.uint8)
        rows, residual, decoded = x.clone(), torch.zeros_like(x), torch.empty_like(x)
        encode_with_feedback_(INT4, rows, wire, residual, decoded)
        assert torch.equal(decoded + residual, x)  # error feedback loses nothing
        assert ((decoded - x).abs().amax(1) <= (x.amax(1) - x.amin(1)) / 14 + 1e-7).all()
    assert INT4.wire_numel(1000) * 2 <= INT8.wire_numel(1000) + 8
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 13.0], [float("nan"), 0.0, 1.0, 2.0, 3.0]])
    out = torch.empty_like(x)
    wire = torch.empty(2, INT4.wire_numel(5), dtype=torch.uint8)
    INT4.encode(x, wire)
    INT4.decode(wire, out)
    assert torch.equal(out[0], x[0]) and out[1].isnan().all()


# -- the rules on one rank, against a hand-written DiLoCo loop -----------------------------------
def _self_transport():
    from mpi4py import MPI

    from lightning_mpi.comm.transport import Transport

    return Transport(MPI.COMM_SELF)


def _steps(bound, net, steps, seed=0):
    """``steps`` inner steps through the rule's hooks (a fresh SGD optimizer, random data from ``seed``)."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(6, 3)).pow(2).mean().backward()
        assert bound.before_step(opt)
        opt.step()
        bound.after_step(opt)


def _train(bound, net, steps, seed=0):
    """A whole run: start, :func:`_steps`, end, close."""
    bound.on_train_start()
    _steps(bound, net, steps, seed)
    bound.on_train_end()
    bound.close()


def test_diloco_on_one_rank_is_the_papers_loop():
    period, steps, lr, mu = 3, 8, 0.7, 0.9
    torch.manual_seed(1)
    net, ref = nn.Linear(3, 2), nn.Linear(3, 2)
    ref.load_state_dict(net.state_dict())
    _train(DiLoCoRule(period=period, outer_warmup=0).bind(_self_transport(), list(net.parameters())), net, steps)

    torch.manual_seed(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    theta_global = [p.detach().clone() for p in ref.parameters()]
    buffers = [torch.zeros_like(t) for t in theta_global]

    def outer():
        with torch.no_grad():
            for p, g, b in zip(ref.parameters(), theta_global, buffers):
                delta = g - p
                b.mul_(mu).add_(delta)
                g.sub_(lr * (delta + mu * b))
                p.copy_(g)

    for step in range(1, steps + 1):
        opt.zero_grad()
        ref(torch.randn(6, 3)).pow(2).mean().backward()
        opt.step()
        if step % period == 0:
            outer()
    # the end folds in the steps since the last outer step by averaging the replicas (one rank: its own
    # weights), not by an outer step
    for p, g in zip(ref.parameters(), theta_global, strict=True):
        with torch.no_grad():
            g.sub_(g - p)
            p.copy_(g)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_streaming_with_one_fragment_no_overlap_no_mixing_is_diloco_on_one_rank():
    torch.manual_seed(2)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    _train(DiLoCoRule(period=3, wire="int8").bind(_self_transport(), list(a.parameters())), a, 8)
    rule = StreamingDiLoCoRule(period=3, fragments=1, overlap_steps=0, mix_alpha=0.0, wire="int8")
    _train(rule.bind(_self_transport(), list(b.parameters())), b, 8)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_reschedule_before_the_first_exchange_trains_as_if_bound_with_the_new_schedule():
    """mpi_auto's first decision: same wire and fragments, another period and τ, set in place."""
    torch.manual_seed(3)
    nets = [nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    moved = StreamingDiLoCoRule(period=8, fragments=2, overlap_steps=1).bind(
        _self_transport(), list(nets[0].parameters())
    )
    fresh = StreamingDiLoCoRule(period=12, fragments=2, overlap_steps=3).bind(
        _self_transport(), list(nets[1].parameters())
    )
    for bound in (moved, fresh):
        bound.on_train_start()
    _steps(moved, nets[0], 2)
    assert moved.reschedule(12, 3)
    assert (moved.period, moved.overlap_steps, moved.offsets) == (fresh.period, fresh.overlap_steps, fresh.offsets)
    _steps(moved, nets[0], 28, seed=1)
    torch.manual_seed(0)  # the first 2 steps of the fresh binding, with the same data
    _steps(fresh, nets[1], 2)
    _steps(fresh, nets[1], 28, seed=1)
    assert moved.outer_steps == fresh.outer_steps > 0
    assert all(torch.equal(p, q) for p, q in zip(nets[0].parameters(), nets[1].parameters()))
    # after an exchange started, or with τ out of range, it refuses and changes nothing
    assert not moved.reschedule(16, 1) and moved.period == 12
    late = StreamingDiLoCoRule(period=8, fragments=2).bind(_self_transport(), list(nn.Linear(3, 2).parameters()))
    assert not late.reschedule(8, 4) and late.overlap_steps == 1
    for bound in (moved, fresh, late):
        bound.close()


def test_a_model_with_fewer_tensors_than_fragments_gets_one_fragment_per_tensor():
    net = nn.Linear(3, 2)
    with pytest.warns(RuntimeWarning, match="fragments=4 is more than the model's 2 trainable tensors"):
        bound = StreamingDiLoCoRule(period=8, fragments=4).bind(_self_transport(), list(net.parameters()))
    assert len(bound.fragments) == 2 and bound.offsets == [4, 8]
    bound.close()


def test_a_blocking_exchange_slower_than_its_steps_warns_once_on_rank_0():
    """mpi_diloco at 100 Mbit/s: the exchange (injected: 1 s per clock read in the rule) against
    steps of a few ms: one warning naming the measurement and the fix; none past the bound."""
    import warnings

    from lightning_mpi.rules.diloco import rule as diloco_module
    from lightning_mpi.rules.diloco.warning import WARN_SHARE, SlowExchangeWarning, slow_exchange_message

    # the measured situations: 1 Gbit/s (0.53 s against 50 steps of 90 ms) stays quiet, 100 Mbit/s warns
    assert slow_exchange_message("mpi_diloco", 0.53, 0.09, 50, "fp32") is None
    text = slow_exchange_message("mpi_diloco", 5.3, 0.09, 50, "fp32")
    assert "5.30 s, 118%" in text and "mpi_streaming_diloco" in text and "mpi_auto" in text
    assert slow_exchange_message("mpi_diloco", WARN_SHARE * 50 * 0.1, 0.1, 50, "fp32") is None
    assert SlowExchangeWarning("mpi_diloco", rank=1, wire="fp32").armed is False  # rank 0 only

    class Clock:  # every read of the rule's clock is 1 s later: its exchange takes seconds
        now = 0.0

        @classmethod
        def perf_counter(cls):
            cls.now += 1.0
            return cls.now

    net = nn.Linear(3, 2)
    bound = DiLoCoRule(period=2).bind(_self_transport(), list(net.parameters()))
    bound.fragments[0].bytes_per_exchange = 1000  # as if it crossed a link (one rank sends nothing)
    original = diloco_module.time
    diloco_module.time = Clock
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _train(bound, net, 6)
    finally:
        diloco_module.time = original
    slow = [w for w in seen if "blocking exchange" in str(w.message)]
    assert len(slow) == 1 and "mpi_diloco" in str(slow[0].message) and "the 2 steps" in str(slow[0].message)
    assert bound.slow_warning.warned


# -- SparseLoCo's wire: error feedback in place of the outer momentum --------------------------------
@pytest.mark.parametrize(
    "make, kwargs, name",
    [
        (DiLoCoRule, {"wire": "sparseloco", "outer_momentum": 0.9}, "outer_momentum"),
        (StreamingDiLoCoRule, {"wire": "sparseloco", "outer_momentum": 0.5}, "outer_momentum"),
        (DiLoCoRule, {"wire": "int4", "error_decay": 0.9}, "error_decay"),
        (StreamingDiLoCoRule, {"error_decay": 0.9}, "error_decay"),  # its default wire is int4
        (DiLoCoRule, {"wire": "sparseloco", "error_decay": 1.5}, "error_decay"),
        (DiLoCoRule, {"wire": "sparseloco", "topk_per_chunk": 0}, "topk_per_chunk"),
        (DiLoCoRule, {"wire": "sparseloco", "topk_per_chunk": 4097}, "topk_per_chunk"),
    ],
)
def test_sparseloco_refuses_what_does_not_go_with_it(make, kwargs, name):
    with pytest.raises(ValueError, match=rf"{name}="):
        make(**kwargs)


def test_the_outer_step_follows_the_wire():
    """None resolves per wire: period 50 and Nesterov 0.7/0.9 on the dense wires (the DiLoCo paper's
    step), and on SparseLoCo's a shorter period and plain SGD (its accumulator is the momentum);
    what is given is kept."""
    from lightning_mpi.comm.sparseloco import SparseLoCoWire
    from lightning_mpi.rules.diloco.rule import ERROR_DECAY, SPARSE_LR, SPARSE_PERIOD

    assert DiLoCoRule().outer_step() == (0.7, 0.9) and StreamingDiLoCoRule().outer_step() == (0.7, 0.9)
    assert DiLoCoRule().inner_period() == StreamingDiLoCoRule().inner_period() == 50
    sparse = StreamingDiLoCoRule(wire="sparseloco")
    assert sparse.outer_step() == (SPARSE_LR, 0.0) and sparse.decay() == ERROR_DECAY
    assert sparse.inner_period() == SPARSE_PERIOD < 50 and sparse.make_wire() == SparseLoCoWire(64)
    given = DiLoCoRule(wire="sparseloco", period=7, outer_lr=0.5, outer_momentum=0.0, error_decay=0.9)
    assert given.outer_step() == (0.5, 0.0) and given.decay() == 0.9 and given.inner_period() == 7
    assert DiLoCoRule(outer_lr=1.0, outer_momentum=0.0).outer_step() == (1.0, 0.0)
    assert StreamingDiLoCoRule(period="auto", wire="sparseloco").inner_period() == "auto"
    with pytest.raises(ValueError, match="overlap_steps=2"):  # checked against the wire's period
        StreamingDiLoCoRule(wire="sparseloco", overlap_steps=2)


def _sparse_round(theta_global, local, accumulator, beta, k, lr):
    """One SparseLoCo outer step of one replica by the per-chunk reference (tests/comm/test_sparseloco.py)."""
    from tests.comm.test_sparseloco import reference

    flat_g = torch.cat([t.reshape(-1) for t in theta_global])
    flat_l = torch.cat([t.detach().reshape(-1) for t in local])
    sizes = [t.numel() for t in theta_global]
    sections = [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]
    accumulator.mul_(beta).add_(flat_g - flat_l)
    sent, _ = reference(accumulator.clone(), sections, k)
    accumulator.sub_(sent)
    flat_g = flat_g - lr * sent
    return list(torch.split(flat_g, sizes))


def test_sparseloco_diloco_on_one_rank_is_the_papers_loop():
    """DiLoCo with ``wire="sparseloco"`` on one rank against SparseLoCo's Algorithm 1 written out: inner
    steps; every H: e ← β·e + Δ, Δ̂ = Q(TopK(e)), e ← e − Δ̂, θ ← θ − α·Δ̂ (the mean of one); the end
    folds the last steps in the same way (α = 1, the average)."""
    period, steps, k, beta, lr = 3, 8, 2, 0.9, 0.8
    torch.manual_seed(1)
    net, ref = nn.Linear(3, 2), nn.Linear(3, 2)
    ref.load_state_dict(net.state_dict())
    rule = DiLoCoRule(period=period, wire="sparseloco", topk_per_chunk=k, error_decay=beta, outer_lr=lr, outer_warmup=0)
    _train(rule.bind(_self_transport(), list(net.parameters())), net, steps)

    torch.manual_seed(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    theta_global = [p.detach().clone() for p in ref.parameters()]
    accumulator = torch.zeros(sum(p.numel() for p in ref.parameters()))

    def outer(step_lr):
        nonlocal theta_global
        flat = _sparse_round(theta_global, list(ref.parameters()), accumulator, beta, k, step_lr)
        theta_global = [f.view_as(t) for f, t in zip(flat, theta_global)]
        with torch.no_grad():
            for p, g in zip(ref.parameters(), theta_global):
                p.copy_(g)

    for step in range(1, steps + 1):
        opt.zero_grad()
        ref(torch.randn(6, 3)).pow(2).mean().backward()
        opt.step()
        if step % period == 0:
            outer(lr)
    outer(1.0)  # the end: the steps since the last outer step, averaged in
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_sparseloco_heal_state_restarts_an_exchange_in_flight_exactly():
    """Streaming DiLoCo on SparseLoCo's wire, bound again mid-run from its ``heal_state()`` while an
    exchange is in flight: the accumulator is this rank's own (``"local"``), the exchange starts
    again from the Δ and accumulator it started from, and the run ends bitwise where the
    uninterrupted one does."""
    rule = StreamingDiLoCoRule(period=4, fragments=2, overlap_steps=1, mix_alpha=0.5, wire="sparseloco", topk_per_chunk=3)

    def run(cut):
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        params = list(net.parameters())
        bound = rule.bind(_self_transport(), params)
        bound.healing = True
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.5)
        bound.on_train_start()
        statuses = []
        for step in range(11):
            if step == cut:
                state = bound.heal_state()
                assert state["local"]["residuals"][0] is not None  # the accumulator travels as this rank's own
                bound.close()
                bound = rule.bind(_self_transport(), params)
                bound.healing = True
                bound.load_state_dict(state)
                bound.on_train_start()
            opt.zero_grad()
            net(torch.randn(6, 3)).pow(2).mean().backward()
            assert bound.before_step(opt)
            opt.step()
            bound.after_step(opt)
            statuses.append([f.status for f in bound.fragments])
        bound.on_train_end()
        bound.close()
        return [p.detach().clone() for p in params], statuses

    whole, statuses = run(None)
    assert statuses[9][0] == "running"
    healed, _ = run(10)
    assert all(torch.equal(a, b) for a, b in zip(whole, healed, strict=True))


def test_sparseloco_checkpoint_resumes_the_accumulator_exactly():
    """``state_dict`` mid-period holds the accumulator; a fresh binding loaded from it (and the inner
    optimizer's state) retraces the uninterrupted run bitwise."""
    rule = DiLoCoRule(period=4, wire="sparseloco", topk_per_chunk=2)

    def run(save_at=None, state=None):
        torch.manual_seed(5)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        params = list(net.parameters())
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.5)
        bound = rule.bind(_self_transport(), params)
        if state is not None:
            bound.load_state_dict(state["rule"])
            opt.load_state_dict(state["opt"])
        bound.on_train_start()
        first = 0 if state is None else state["step"]
        torch.manual_seed(100 + first)
        saved = None
        for step in range(first, 11):
            if step == save_at:
                saved = {"rule": bound.state_dict(), "opt": opt.state_dict(), "step": step}
                torch.manual_seed(100 + step)
            opt.zero_grad()
            net(torch.randn(6, 3)).pow(2).mean().backward()
            assert bound.before_step(opt)
            opt.step()
            bound.after_step(opt)
        bound.on_train_end()
        bound.close()
        return [p.detach().clone() for p in params], saved

    whole, saved = run(save_at=6)
    assert saved["rule"]["ranks"][0]["residuals"][0].abs().sum() > 0  # the accumulator is in the checkpoint
    resumed, _ = run(state=saved)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))
