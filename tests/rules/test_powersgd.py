"""PowerSGD's math and one bucket on one rank (lightning_mpi.rules.powersgd: .rule, .lowrank,
.bucket), against torch's powerSGD_hook arithmetic and hand math."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _should_compress

from lightning_mpi.comm.buffers import make_buckets
from lightning_mpi.rules.powersgd.bucket import PowerSGDBucket
from lightning_mpi.rules.powersgd.lowrank import compression_rank, orthogonalize_, power_step, q_seed, random_qs
from tests.mpi_utils import REPO

SCRIPT = REPO / "tests" / "scripts" / "powersgd_train.py"


# -- the math ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(16, 10), (3, 16), (8, 3, 3, 3), (16,), (5, 1), (0, 4)])
@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("rate", [0.0, 1.0, 2.0, 8.0])
def test_compression_rank_follows_torch(shape, rank, rate):
    r = compression_rank(shape, rank, rate)
    if len(shape) < 2 or 0 in shape:
        assert r == 0  # 1-D and empty tensors are averaged as they are
        return
    n, m = shape[0], int(torch.Size(shape).numel()) // shape[0]
    torch_says, _, _ = _should_compress(n, m, min(n, m, rank), rate)
    assert (r > 0) == torch_says
    assert r in (0, min(n, m, rank))


@pytest.mark.parametrize("r", [1, 2, 5])
def test_orthogonalize_spans_what_torch_spans(r):
    torch.manual_seed(0)
    p = torch.randn(12, r, dtype=torch.float64)
    ours = orthogonalize_(p.clone())
    theirs = p.clone().unsqueeze(0)
    _orthogonalize(theirs)
    assert torch.allclose(ours.t() @ ours, torch.eye(r, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(ours @ ours.t(), theirs[0] @ theirs[0].t(), atol=1e-12)  # the same projection


def test_orthogonalize_keeps_dependent_and_zero_columns_finite():
    dependent = torch.randn(6, 1).repeat(1, 3)
    q = orthogonalize_(dependent)
    assert torch.isfinite(q).all() and torch.allclose(q.t() @ q, torch.eye(3), atol=1e-5)
    assert torch.equal(orthogonalize_(torch.zeros(6, 1)), torch.zeros(6, 1))


def torch_power_step(matrices, q):
    """torch's powerSGD_hook arithmetic for one bucket (bmm, its _orthogonalize), W ranks in one process."""
    q = q.clone().unsqueeze(0)
    _orthogonalize(q)
    p = sum(torch.bmm(m.unsqueeze(0), q) for m in matrices)  # allreduce-sum of P
    _orthogonalize(p)
    new_q = sum(torch.bmm(m.unsqueeze(0).transpose(1, 2), p) for m in matrices) / len(matrices)
    return torch.bmm(p, new_q.transpose(1, 2))[0], new_q[0]


@pytest.mark.parametrize("r", [1, 3])
def test_power_step_matches_torch_hook_arithmetic(r):
    torch.manual_seed(1)
    matrices = [torch.randn(20, 7, dtype=torch.float64) for _ in range(3)]
    q = torch.randn(7, r, dtype=torch.float64)
    ours, our_q = power_step(matrices, q)
    theirs, their_q = torch_power_step(matrices, q)
    assert torch.allclose(ours, theirs, atol=1e-10)
    # Q differs only by the orientation (signs) of P̂'s columns, which P̂ Qᵀ cancels
    assert torch.allclose(our_q.abs(), their_q.abs(), atol=1e-10)


@pytest.mark.parametrize("shape", [(16, 10), (10, 16), (3, 16)])
@pytest.mark.parametrize("samples", [2, 40])  # 2: the mean has lower rank than min(n, m)
def test_full_rank_is_the_exact_mean(shape, samples):
    torch.manual_seed(2)
    # gradients of a linear layer: sums of outer products, of rank <= samples
    matrices = [torch.randn(shape[0], samples) @ torch.randn(samples, shape[1]) for _ in range(2)]
    q = torch.randn(shape[1], min(shape))
    approx, _ = power_step(matrices, q)
    assert torch.allclose(approx, torch.stack(matrices).mean(0), atol=1e-5)


def test_warm_started_power_steps_reach_the_best_rank_r_approximation():
    torch.manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(30, 30, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(20, 20, dtype=torch.float64))
    s = torch.tensor([10.0, 5.0, 1.0] + [0.1] * 17, dtype=torch.float64)
    m = u[:, :20] @ torch.diag(s) @ v.t()
    q = torch.randn(20, 2, dtype=torch.float64)
    for _ in range(40):
        approx, q = power_step([m], q)
    best = u[:, :2] @ torch.diag(s[:2]) @ v[:, :2].t()  # Eckart-Young
    assert torch.allclose(approx, best, atol=1e-8)


def test_fresh_qs_are_the_same_on_every_rank_and_new_every_step():
    shapes = [(7, 2), (3, 1)]
    first = random_qs(shapes, q_seed(0, 5, 1), torch.float32)
    again = random_qs(shapes, q_seed(0, 5, 1), torch.float32)
    later = random_qs(shapes, q_seed(0, 6, 1), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], later[0])
    assert q_seed(0, 5, 1) != q_seed(0, 5, 2) != q_seed(1, 5, 2)


def test_one_bucket_on_one_rank_applies_the_power_step_and_keeps_the_residual():
    from mpi4py import MPI

    from lightning_mpi.comm.transport import Transport

    torch.manual_seed(4)
    params = [torch.zeros(16, 10, requires_grad=True), torch.zeros(8, 3, 3, 3, requires_grad=True),
              torch.zeros(16, requires_grad=True)]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in params]
    (bucket,) = make_buckets(params, 1)
    pb = PowerSGDBucket(bucket, Transport(MPI.COMM_SELF), lambda shape: compression_rank(shape, 2, 1.0), True)
    assert [c.member for c in pb.compressed] and [u.member for u in pb.plain]
    qs = {}

    def fresh(shapes):
        values = random_qs(shapes, 11, torch.float32)
        qs.update({shape: v.clone() for shape, v in zip(shapes, values)})
        return values

    pb.begin(True, fresh)
    for request in pb.steps(True):
        request.Wait()
    assert pb.commit(True, warm_start=True) and pb.q_ready
    for p, g in zip(params, grads):
        if p.dim() == 1:
            assert torch.equal(p.grad, g)  # averaged uncompressed over one rank
            continue
        m = g.reshape(g.shape[0], -1)
        expected, expected_q = power_step([m], qs[(m.shape[1], 2)])
        assert torch.allclose(p.grad.reshape(m.shape), expected, atol=1e-5)
        c = next(c for c in pb.compressed if bucket.tensors[c.member] is p)
        assert torch.allclose(pb.residual_of(c), m - expected, atol=1e-5)  # error feedback
        assert torch.allclose(pb.q(c, pb.q_state), expected_q, atol=1e-5)  # warm start for the next step


# -- arguments ------------------------------------------------------------------------------------
