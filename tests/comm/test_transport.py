"""Transport layer: buckets, codecs and the ASA exchange (in process, on simulated ranks), and every
collective against numpy (mpiexec)."""
import json

import pytest
import torch

from lightning_mpi.comm.buffers import make_buckets, padded_numel
from lightning_mpi.comm.codecs import BF16, FP16, FP32, INT8, ONEBIT, get_codec
from lightning_mpi.comm.collectives import ASAWorkspace, asa_mean_steps
from lightning_mpi.comm.errors import AbandonedRunError
from lightning_mpi.comm.resources import live_handles
from lightning_mpi.comm.transport import CollectiveTimeout, Transport, wait_request
from tests.mpi_utils import REPO, run_mpi

SCRIPT = str(REPO / "tests" / "scripts" / "comm_check.py")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_buckets_pad_to_world_size_for_any_shapes(world):
    shapes = [(3, 5), (7,), (1,), (2, 3, 4), ()]
    tensors = [torch.randn(s) for s in shapes]
    buckets = make_buckets(tensors, world, bucket_bytes=64)
    assert sorted(id(t) for b in buckets for t in b.tensors) == sorted(id(t) for t in tensors)
    for bucket in buckets:
        assert bucket.flat.numel() % world == 0
        assert bucket.flat.numel() - bucket.numel < world
        bucket.pack()
        assert torch.all(bucket.flat[bucket.numel :] == 0)  # padding is zero
        for t, v in zip(bucket.tensors, bucket.views()):
            assert torch.equal(t, v)
        bucket.flat.mul_(2)
        bucket.unpack()
    assert all(torch.equal(t, t0 * 2) for t, t0 in zip(tensors, [t.clone() / 2 for t in tensors]))


def test_buckets_end_on_whole_layers_and_the_first_is_small():
    # Three Linear-like layers registered weight, bias: backward makes each layer's two gradients
    # at once, last layer first. A bucket must never end on the next layer's bias (it would wait
    # for that layer's backward), and the first bucket holds the last layer only.
    layers = [(torch.zeros(1000), torch.zeros(10)) for _ in range(3)]  # 4,000 B + 40 B each
    tensors = [t for layer in layers for t in layer]
    buckets = make_buckets(tensors, 2, bucket_bytes=6000, first_bucket_bytes=100)
    names = {id(t): f"{kind}{i}" for i, layer in enumerate(layers) for kind, t in zip("wb", layer)}
    assert [[names[id(t)] for t in b.tensors] for b in buckets] == [["b2", "w2"], ["b1", "w1", "b0", "w0"]]
    # without a first-bucket size every bucket uses bucket_bytes, still closing on whole layers
    buckets = make_buckets(tensors, 2, bucket_bytes=4040)
    assert [[names[id(t)] for t in b.tensors] for b in buckets] == [["b2", "w2"], ["b1", "w1"], ["b0", "w0"]]
    with pytest.raises(ValueError, match=r"first_bucket_bytes=0 must be >= 1 or None"):
        make_buckets(tensors, 2, bucket_bytes=10, first_bucket_bytes=0)


def test_bucket_grads_missing_grad_packs_zeros_and_unpacks_a_new_grad():
    a, b = torch.randn(4, requires_grad=True), torch.randn(3, requires_grad=True)
    a.grad = torch.ones(4)
    (bucket,) = make_buckets([a, b], 2)
    bucket.pack_grads()
    assert bucket.flat.tolist()[:7].count(0.0) == 3
    bucket.flat.fill_(5)
    bucket.unpack_grads()
    assert torch.equal(a.grad, torch.full((4,), 5.0)) and torch.equal(b.grad, torch.full((3,), 5.0))


def test_buckets_are_reused_not_reallocated():
    p = torch.randn(10)
    (bucket,) = make_buckets([p], 3)
    ptr = bucket.flat.data_ptr()
    for _ in range(3):
        bucket.pack()
        bucket.unpack()
    assert bucket.flat.data_ptr() == ptr


def test_padded_numel():
    assert [padded_numel(n, 3) for n in (0, 1, 3, 4)] == [0, 3, 3, 6]
    with pytest.raises(ValueError, match="multiple"):
        padded_numel(3, 0)


@pytest.mark.parametrize("codec,tol", [(FP32, 0.0), (FP16, 2**-11), (BF16, 2**-8)])
@pytest.mark.parametrize("n", [1, 5, 17, 1001])
def test_codec_round_trip_odd_sizes(codec, tol, n):
    rows = torch.randn(3, n) * torch.tensor([[1e-7], [1.0], [3e4]])  # tiny, normal, near fp16's limit
    wire = torch.empty(3, codec.wire_numel(n), dtype=codec.wire_dtype)
    codec.encode(rows, wire)
    back = torch.empty_like(rows)
    codec.decode(wire, back)
    rel = ((back - rows).abs().amax(1) / rows.abs().amax(1)).max().item()
    assert rel <= tol
    assert torch.isfinite(back).all()


def fp16_round_trip(rows):
    wire = torch.empty(rows.shape[0], FP16.wire_numel(rows.shape[1]), dtype=FP16.wire_dtype)
    FP16.encode(rows, wire)
    out = torch.empty_like(rows)
    FP16.decode(wire, out)
    return out


def test_fp16_scaling_prevents_overflow_and_underflow():
    rows = torch.tensor([[1e6, -2e6, 3.0], [1e-9, -3e-9, 2e-9]])
    out = fp16_round_trip(rows)
    assert torch.isfinite(out[0]).all()  # plain .half() would give inf
    assert (out[1] != 0).all()  # plain .half() would flush to zero


def test_codec_passes_non_finite_through():
    assert not torch.isfinite(fp16_round_trip(torch.tensor([[1.0, float("inf"), 2.0]]))).all()


def test_unknown_codec_names_the_argument():
    with pytest.raises(ValueError, match=r"wire='fp8'.*choose one of"):
        get_codec("fp8")


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_match_numpy(world, tmp_path):
    out = tmp_path / "result.json"
    run_mpi(world, [SCRIPT, str(out)], timeout=150)
    result = json.loads(out.read_text())
    assert result["world_size"] == world
    assert result["not_identical"] == []
    errors = result["errors"]
    assert len(errors) > 100
    for case, err in errors.items():
        if case.startswith("asa_fp16"):
            assert err <= 2e-3, case
        elif case.startswith("asa_bf16"):
            assert err <= 1.6e-2, case
        elif "mean" in case or case.startswith("asa_fp32"):
            assert err <= 1e-6, case
        elif case.startswith("allreduce_sum/torch.float"):
            assert err <= 1e-5, case  # MPI may add in another order than numpy
        else:
            assert err == 0.0, case


class _SimRank:
    """One of ``size`` simulated ranks: its collectives post buffers; :func:`_run_ranks` moves the data."""

    def __init__(self, rank, size, posts):
        self.rank, self.size, self.posts = rank, size, posts

    def ialltoall(self, send, recv):
        self.posts[self.rank] = ("alltoall", send, recv)
        yield "alltoall"

    def iallgather(self, send, recv):
        self.posts[self.rank] = ("allgather", send, recv)
        yield "allgather"


def _run_ranks(steps, posts):
    """Drive one exchange generator per rank in lockstep, doing each collective's copies."""
    for gen in steps:
        next(gen)
    world = len(steps)
    while True:
        kind = posts[0][0]
        for j in range(world):
            for i in range(world):
                posts[j][2][i].copy_(posts[i][1][j] if kind == "alltoall" else posts[i][1][0])
        done = 0
        for gen in steps:
            try:
                next(gen)
            except StopIteration:
                done += 1
        if done == world:
            return


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("codec", [INT8, ONEBIT], ids=lambda c: c.name)
def test_asa_with_feedback_on_simulated_ranks(codec, world):
    # Every rank ends each step with the same values (its own row, sent exactly, included), and
    # applied updates + pending residuals = mean of the gradients: exactly when the mean's
    # division is exact (world 4), to fp32 rounding of that division otherwise (world 3).
    chunk = 37
    n = world * chunk
    gen = torch.Generator().manual_seed(world)
    # Start from pending residuals everywhere, own rows included (as after a restore from another
    # world size): they must be sent too, not kept or lost.
    residuals = [torch.randint(-64, 65, (n,), generator=gen).float() / 1024 for _ in range(world)]
    owners = [torch.randint(-64, 65, (chunk,), generator=gen).float() / 1024 for _ in range(world)]
    works = [ASAWorkspace.for_buffer(torch.empty(n), world, codec) for _ in range(world)]
    applied = torch.zeros(n, dtype=torch.float64)
    given = torch.stack(residuals).double().mean(dim=0) + torch.cat(owners).double()
    for _ in range(30):
        grads = [torch.randint(-1024, 1025, (n,), generator=gen).float() / 1024 for _ in range(world)]
        flats = [g.clone() for g in grads]
        posts = [None] * world
        steps = [
            asa_mean_steps(_SimRank(r, world, posts), flats[r], codec, works[r], residuals[r], owners[r])
            for r in range(world)
        ]
        _run_ranks(steps, posts)
        assert all(torch.equal(flats[0], f) for f in flats[1:])
        applied += flats[0].double()
        given += torch.stack(grads).double().mean(dim=0)
    pending = torch.stack(residuals).double().mean(dim=0) + torch.cat(owners).double()
    diff = (applied + pending - given).abs().max().item()
    assert diff == 0.0 if world == 4 else diff < 1e-5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec", [FP32, FP16, BF16, INT8, ONEBIT], ids=lambda c: c.name)
def test_asa_without_feedback_on_simulated_ranks(codec, world):
    # Every wire format goes through the one ASA: identical results everywhere, near the mean.
    chunk = 29
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(world * chunk, generator=gen) for _ in range(world)]
    flats = [g.clone() for g in grads]
    posts = [None] * world
    works = [ASAWorkspace.for_buffer(flats[0], world, codec) for _ in range(world)]
    _run_ranks([asa_mean_steps(_SimRank(r, world, posts), flats[r], codec, works[r]) for r in range(world)], posts)
    assert all(torch.equal(flats[0], f) for f in flats[1:])
    err = (flats[0] - torch.stack(grads).mean(dim=0)).abs().max().item()
    assert err == pytest.approx(0.0, abs=1e-6) if codec is FP32 else err < (2.0 if codec is ONEBIT else 0.05)


# -- waits and the transport's own objects (comm/transport), on one rank ---------------------------
class _CompletesAfter:
    """A stand-in request that completes at its ``n``-th ``Test`` (never, for ``None``)."""

    def __init__(self, n):
        self.n, self.tests = n, 0

    def Test(self):  # noqa: N802  (mpi4py's name)
        self.tests += 1
        return self.n is not None and self.tests >= self.n


def _failed():
    raise RuntimeError("rank 2 failed")


def test_a_wait_that_nobody_joins_times_out_with_the_fix():
    expected = r"broadcast on rank 1 waited more than 0.01 s for the other 2 rank"
    with pytest.raises(CollectiveTimeout, match=expected) as info:
        wait_request(_CompletesAfter(None), 0.01, "broadcast", 1, 3)
    assert "collective_timeout" in str(info.value)


def test_a_wait_raises_what_the_watch_raises():
    with pytest.raises(RuntimeError, match="rank 2 failed"):
        wait_request(_CompletesAfter(None), None, "barrier", 0, 3, watch=_failed)


def test_a_settling_wait_completes_an_agreement_another_rank_already_finished():
    # The failure is known, but the request completes: every rank joined, so go on.
    request = _CompletesAfter(150)
    wait_request(request, None, "barrier", 0, 3, watch=_failed, settle=True)
    assert request.tests >= 150


def test_transport_on_one_rank(MPI):
    before = live_handles()
    transport = Transport(MPI.COMM_SELF, timeout=10)
    assert (transport.rank, transport.size) == (0, 1)
    assert transport.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}
    assert transport.allgather_object(("x", 3)) == [("x", 3)]
    assert transport.agree(7) == [7]
    x = torch.arange(4, dtype=torch.float32)
    assert transport.allreduce_(x.clone(), "max").tolist() == x.tolist()
    with pytest.raises(TypeError, match="upcast to float32"):
        transport.allreduce_(x.half())
    twin = transport.dup()
    assert twin.resources is transport.resources and live_handles()["comms"] == before["comms"] + 1
    twin.free()
    local, leaders = transport.node_split()
    assert local.size == 1 and leaders is not None and leaders.size == 1
    local.free()
    leaders.free()
    transport.free()  # COMM_SELF itself is never freed
    assert live_handles() == before


def test_an_abandoned_run_refuses_its_transport(MPI):
    transport = Transport(MPI.COMM_SELF, timeout=10)
    transport.resources.abandon()
    assert transport.abandoned
    with pytest.raises(AbandonedRunError, match="start a new run"):
        transport.barrier()
