"""Each rule's update as a pure function, against numbers worked out by hand; argument checks.

No MPI here: the functions take tensors and return tensors.
"""
import pytest
import torch

from lightning_mpi import (
    ADAGStrategy,
    AEASGDStrategy,
    AGNStrategy,
    DownpourStrategy,
    DynSGDStrategy,
    EAMSGDStrategy,
    EASGDStrategy,
    GoSGDStrategy,
    ModelAveragingStrategy,
)
from lightning_mpi.rules.averaging import ModelAveragingRule, averages_at
from lightning_mpi.rules.easgd import (
    EASGDRule,
    default_alpha,
    easgd_sync_update,
    elastic_difference,
    nesterov_gradient_,
)
from lightning_mpi.rules.gossip import GoSGDRule, gossip_merge, gossip_push_weight, weighted_consensus
from lightning_mpi.rules.server import (
    ADAGRule,
    AEASGDRule,
    AGNRule,
    DownpourRule,
    DynSGDRule,
    EAMSGDRule,
)
from lightning_mpi.rules.server.commits import (
    adag_commit,
    adag_scale,
    aeasgd_exchange,
    agn_commit,
    downpour_commit,
    dynsgd_commit,
    dynsgd_scale,
    staleness,
)

T = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731


def model_average(replicas):
    """The mean of the replicas' flat weights (what one averaging round leaves on every rank)."""
    return torch.stack(list(replicas)).mean(0)


def test_easgd_sync_update_by_hand():
    # Two workers θ1 = [1, 2], θ2 = [3, -2], center [0, 0], α = 0.25.
    center = T(0.0, 0.0)
    t1, t2 = T(1.0, 2.0), T(3.0, -2.0)
    total = (t1 - center) + (t2 - center)  # [4, 0]
    new1, c1 = easgd_sync_update(t1, center, total, 0.25)
    new2, c2 = easgd_sync_update(t2, center, total, 0.25)
    assert new1.tolist() == [0.75, 1.5]  # 1 - .25*1, 2 - .25*2
    assert new2.tolist() == [2.25, -1.5]
    assert c1.tolist() == c2.tolist() == [1.0, 0.0]  # 0 + .25*4, 0 + .25*0
    # the elastic force is symmetric: what workers lose, the center gains
    assert torch.allclose((t1 + t2 + center) - (new1 + new2 + c1), T(0.0, 0.0))


def test_elastic_difference_and_default_alpha():
    assert elastic_difference(T(2.0, 0.0), T(1.0, 1.0), 0.5).tolist() == [0.5, -0.5]
    assert default_alpha(None, 3) == pytest.approx(0.3)  # Zhang et al.: β = Wα = 0.9
    assert default_alpha(0.2, 3) == 0.2


def test_nesterov_gradient_by_hand():
    g, buf = T(1.0, -2.0), T(0.5, 0.0)
    nesterov_gradient_(g, buf, 0.9)
    assert buf.tolist() == pytest.approx([1.45, -2.0])  # .9*.5 + 1, 0 - 2
    assert g.tolist() == pytest.approx([1.0 + 0.9 * 1.45, -2.0 - 1.8])
    # δ = 0 is plain SGD
    g2, b2 = T(3.0), T(7.0)
    assert nesterov_gradient_(g2, b2, 0.0).tolist() == [3.0]


def test_model_average_and_schedule():
    assert model_average([T(1.0, 2.0), T(3.0, 6.0), T(2.0, 1.0)]).tolist() == [2.0, 3.0]
    schedule = [averages_at(s, period=3, sync_warmup_steps=2) for s in range(1, 9)]
    assert schedule == ["gradients", "gradients", "none", "none", "weights", "none", "none", "weights"]


def test_server_commits_by_hand():
    delta = T(2.0, -4.0)
    assert downpour_commit(delta).tolist() == [2.0, -4.0]
    assert agn_commit(delta, 4).tolist() == [0.5, -1.0]
    assert staleness(clock_before_commit=7, clock_at_pull=4) == 3
    assert dynsgd_scale(3) == 0.25
    assert dynsgd_commit(delta, stale=3).tolist() == [0.5, -1.0]
    assert dynsgd_commit(delta, stale=0).tolist() == [2.0, -4.0]  # fresh: unchanged


def test_aeasgd_exchange_by_hand():
    # E = α(θ − θ̃) = 0.5 · ([2, 0] − [1, 1]) = [0.5, -0.5]: the worker loses E, the center gains it.
    new_theta, e = aeasgd_exchange(T(2.0, 0.0), T(1.0, 1.0), 0.5)
    assert new_theta.tolist() == [1.5, 0.5] and e.tolist() == [0.5, -0.5]


def test_server_rules_are_told_apart_by_class():
    names = [cls().name for cls in (DownpourRule, AGNRule, DynSGDRule, ADAGRule, AEASGDRule, EAMSGDRule)]
    assert names == ["downpour", "agn", "dynsgd", "adag", "aeasgd", "eamsgd"]


def test_adag_scale_uses_the_global_norm():
    # center moved by [3, 4] since the pull: ‖·‖² = 25 over the whole vector; η = 5 → 1/(5+1)
    now, pulled = T(3.0, 5.0), T(0.0, 1.0)
    assert adag_scale(now, pulled, 5.0) == pytest.approx(1 / 6)
    commit = adag_commit(T(6.0, -12.0), center_now=now, center_pulled=pulled, eta=5.0)
    assert commit.tolist() == pytest.approx([1.0, -2.0])  # one scalar: the direction is kept
    assert adag_scale(pulled, pulled, 5.0) == 1.0  # center did not move: full commit


def test_gossip_by_hand():
    assert gossip_push_weight(0.5) == 0.25
    theta, w = gossip_merge(T(0.0, 4.0), 0.25, T(4.0, 0.0), 0.75)
    assert theta.tolist() == [3.0, 1.0] and w == 1.0
    # Σ w θ / Σ w
    assert weighted_consensus([T(1.0), T(4.0)], [0.75, 0.25]).tolist() == [1.75]


def test_gossip_conserves_weight_and_weighted_mean():
    # One push i -> j: the weighted mean Σ wθ and Σ w are unchanged.
    thetas, weights = [T(1.0, 0.0), T(5.0, 2.0), T(-1.0, 1.0)], [1 / 3] * 3
    before = weighted_consensus(thetas, weights)
    weights[0] = gossip_push_weight(weights[0])
    thetas[2], weights[2] = gossip_merge(thetas[2], weights[2], thetas[0], weights[0])
    assert sum(weights) == pytest.approx(1.0)
    assert torch.allclose(weighted_consensus(thetas, weights), before)


BAD = [
    (EASGDRule, {"period": 0}, r"period=0 is out of range: it must be an integer >= 1"),
    (EASGDRule, {"alpha": 0.0}, r"alpha=0.0 is out of range: it must be in \(0.0, 1.0\]"),
    (EASGDRule, {"alpha": 1.5}, r"alpha=1.5 is out of range"),
    (EASGDRule, {"period": 2.5}, r"period=2.5 is out of range: it must be an integer >= 1"),
    (ModelAveragingRule, {"period": -1}, r"period=-1 is out of range"),
    (ModelAveragingRule, {"sync_warmup_steps": -1}, r"sync_warmup_steps=-1 is out of range: it must be an integer >= 0"),
    (DownpourRule, {"period": 0}, r"period=0 is out of range"),
    (AGNRule, {"period": 0}, r"period=0 is out of range"),
    (DynSGDRule, {"period": 0}, r"period=0 is out of range"),
    (ADAGRule, {"eta": 0.0}, r"eta=0.0 is out of range: it must be in \(0.0, inf\)"),
    (AEASGDRule, {"alpha": -0.1}, r"alpha=-0.1 is out of range: it must be in \(0.0, 1.0\]"),
    (EAMSGDRule, {"momentum": 1.0}, r"momentum=1.0 is out of range: it must be in \[0.0, 1.0\)"),
    (EAMSGDRule, {"period": 0}, r"period=0 is out of range"),
    (GoSGDRule, {"p": 0.0}, r"p=0.0 is out of range: it must be in \(0.0, 1.0\]"),
    (GoSGDRule, {"p": 1.01}, r"p=1.01 is out of range"),
]


@pytest.mark.parametrize("cls,kwargs,match", BAD, ids=[f"{c.__name__}-{k}" for c, k, _ in BAD])
def test_bad_hyperparameters_raise(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (EASGDStrategy, {"alpha": 2.0}),
        (ModelAveragingStrategy, {"period": 0}),
        (DownpourStrategy, {"period": 0}),
        (AGNStrategy, {"period": 0}),
        (ADAGStrategy, {"eta": -1.0}),
        (DynSGDStrategy, {"period": 0}),
        (AEASGDStrategy, {"alpha": 0.0}),
        (EAMSGDStrategy, {"momentum": -0.5}),
        (GoSGDStrategy, {"p": 0.0}),
    ],
)
def test_strategies_validate_at_construction(cls, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        cls(**kwargs)


def test_valid_edges_are_accepted():
    EASGDRule(period=1, alpha=1.0)
    GoSGDRule(p=1.0)
    EAMSGDRule(momentum=0.0)
    ModelAveragingRule(period=1, sync_warmup_steps=0)
