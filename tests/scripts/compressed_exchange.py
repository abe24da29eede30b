"""Run on W ranks: the compressed rules driven directly (no Trainer). JSON to argv[1] from rank 0.

- ``topk`` at ratio 1.0 and ``int8`` on exactly representable values give bitwise the gradients
  of fp32 ``asa``;
- error feedback conserves mass exactly: applied updates + pending residuals = mean of gradients;
- ``state_dict`` / ``load_state_dict`` restore the residuals: a restored rule continues bitwise
  like the original.
"""
import json
import sys

import torch
from mpi4py import MPI

from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.compressed import CompressedSyncRule
from lightning_mpi.rules.sync import SyncRule

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
T = Transport(COMM)
SHAPES = [(37, 5), (13,), (7, 3, 3), (1,)]  # odd sizes; several buckets and segments below
SMALL = dict(bucket_mb=600 / 2**20, segment_mb=200 / 2**20)


def make_params():
    return [torch.zeros(s, requires_grad=True) for s in SHAPES]


def exchange(bound, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt = torch.optim.SGD(params, lr=0.1)
    ok = bound.before_step(opt)
    return ok, [p.grad.clone() for p in params]


def random_grads(seed, dyadic=False):
    gen = torch.Generator().manual_seed(seed * 1000 + RANK)
    if dyadic:  # multiples of 2**-10 in [-1, 1]: sums of them stay exact in fp32
        return [torch.randint(-1024, 1025, s, generator=gen).float() / 1024 for s in SHAPES]
    return [torch.randn(s, generator=gen) for s in SHAPES]


result = {"world_size": W}

# -- equivalence with fp32 ASA --------------------------------------------------------------------
params = make_params()
asa = SyncRule(exchange="asa", **SMALL).bind(T, params)
cases = {
    # "pairs": float32 values ("delta16" rounds them to bfloat16, into the residual)
    "topk_ratio1": (CompressedSyncRule(wire="topk", ratio=1.0, topk_packing="pairs", **SMALL), lambda s: random_grads(s)),
    # W times integers in [-40, 40]: spans below 254, so every chunk and the (integer) mean
    # sit on int8's unit grid exactly.
    "int8_exact": (
        CompressedSyncRule(wire="int8", **SMALL),
        lambda s: [(torch.randint(-40, 41, sh, generator=torch.Generator().manual_seed(s * 7 + RANK)) * W).float() for sh in SHAPES],
    ),
}
for name, (rule, make) in cases.items():
    bound = rule.bind(T, params)
    same = True
    for step in range(5):
        grads = make(step)
        _, want = exchange(asa, params, grads)
        _, got = exchange(bound, params, grads)
        same &= all(torch.equal(a, b) for a, b in zip(want, got))
    result[name] = {"equal": same, "stats": bound.stats()}
    bound.close()
asa.close()


# -- momentum correction handed to an optimizer with momentum of its own: at ratio 1 without
#    masking, the trajectory of fp32 ASA with the same optimizer (DGC's velocity, applied once) ----
params_a, params_b = make_params(), make_params()
asa = SyncRule(exchange="asa", **SMALL).bind(T, params_a)
dgc = CompressedSyncRule(
    wire="topk", ratio=1.0, momentum_correction=True, momentum_masking=False, topk_packing="pairs", **SMALL
).bind(T, params_b)
opt_a = torch.optim.SGD(params_a, lr=0.1, momentum=0.9)
opt_b = torch.optim.SGD(params_b, lr=0.1, momentum=0.9)
for step in range(6):
    grads = random_grads(50 + step)
    for params, bound, opt in ((params_a, asa, opt_a), (params_b, dgc, opt_b)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        bound.before_step(opt)
        opt.step()
result["topk_momentum_ratio1"] = {
    "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(params_a, params_b)),
    "momentum": dgc.exchanger.momentum,
    "compensated_steps": dgc.handoff.steps,
}
asa.close()
dgc.close()


# -- mass conservation ----------------------------------------------------------------------------
def allsum(t):
    t = t.double().contiguous()
    T.allreduce_(t, "sum")
    return t


for wire in ("int8", "topk", "onebit", "topk_delta16"):
    for mc in (False,):  # momentum correction sends momentum, not gradients: not a mass identity
        params = make_params()
        packing = {"topk_packing": "delta16" if wire == "topk_delta16" else "pairs"} if wire.startswith("topk") else {}
        rule = CompressedSyncRule(
            wire=wire.split("_")[0], ratio=0.05, momentum_correction=mc, momentum=0.5, ratio_warmup_steps=5, **SMALL, **packing
        )
        bound = rule.bind(T, params)
        applied = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        given = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        for step in range(40):
            grads = random_grads(step, dyadic=True)
            _, got = exchange(bound, params, grads)
            for a, g in zip(applied, got):
                a += g.double()
            for a, g in zip(given, grads):
                a += g.double()
        ex = bound.exchanger
        # Pending mass of the mean update: mean over ranks of residuals (+ momentum buffers, which
        # DGC has not sent yet either), plus every owner's residual of its chunk of the mean.
        pending = []
        for b, bucket in enumerate(bound.buckets):
            flat = allsum(ex.residuals[b]) / W if ex.residuals[b].numel() else torch.zeros(bucket.flat.numel(), dtype=torch.float64)
            if ex.owner_residuals[b].numel():
                owned = torch.zeros(W, ex.owner_residuals[b].numel(), dtype=torch.float64)
                T.allgather(ex.owner_residuals[b].double().reshape(1, -1), owned)
                # owner residuals follow the segment layout: chunk j of each segment is rank j's
                _, parts, _ = ex._slots[id(bucket)]
                start = ostart = 0
                for part in parts:
                    c = part.numel() // W
                    flat[start : start + part.numel()] += owned[:, ostart : ostart + c].reshape(-1)
                    start += part.numel()
                    ostart += c
            pending.append(flat)
        mismatch = 0.0
        for b, bucket in enumerate(bound.buckets):
            for tensor, offset in zip(bucket.tensors, bucket.offsets):
                i = next(j for j, p in enumerate(params) if p is tensor)
                lhs = applied[i].reshape(-1) + pending[b][offset : offset + tensor.numel()]
                if mc:  # momentum correction: updates carry momentum, so the sum is of u, not g
                    break
                rhs = allsum(given[i]).reshape(-1) / W
                mismatch = max(mismatch, float((lhs - rhs).abs().max()))
        key = wire + ("_mc" if mc else "")
        result[f"mass_{key}"] = {"max_abs_diff": mismatch, "wire_bytes": bound.stats()["wire_bytes"], "dense_bytes": bound.stats()["dense_bytes"]}
        bound.close()


# -- checkpoint round trip ------------------------------------------------------------------------
restored_equal = {}
for wire in ("int8", "topk", "onebit"):
    params = make_params()
    rule = CompressedSyncRule(wire=wire, ratio=0.1, ratio_warmup_steps=8, **SMALL)
    a = rule.bind(T, params)
    for step in range(4):
        exchange(a, params, random_grads(step))
    state = a.state_dict()
    b = rule.bind(T, params)
    b.load_state_dict(state)
    nonzero = any(float(r.abs().sum()) > 0 for r in a.exchanger.residuals)
    same = all(torch.equal(x, y) for x, y in zip(a.exchanger.residuals, b.exchanger.residuals))
    same &= all(torch.equal(x, y) for x, y in zip(a.exchanger.owner_residuals, b.exchanger.owner_residuals))
    grads = random_grads(99)
    _, ga = exchange(a, params, grads)
    _, gb = exchange(b, params, grads)
    fresh = rule.bind(T, params)
    _, gf = exchange(fresh, params, grads)
    restored_equal[wire] = {
        "residuals_nonzero": nonzero,
        "residuals_equal": same,
        "next_step_equal": all(torch.equal(x, y) for x, y in zip(ga, gb)),
        "fresh_differs": not all(torch.equal(x, y) for x, y in zip(ga, gf)),
        "step": b.exchanger.step,
    }
    for r in (a, b, fresh):
        r.close()

# Momentum correction beside an optimizer with momentum: the velocity, S_(t-1) and m come back.
params = make_params()
rule = CompressedSyncRule(wire="topk", ratio=0.1, momentum_correction=True, ratio_warmup_steps=0, **SMALL)
a = rule.bind(T, params)


def exchange_m(bound, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    bound.before_step(torch.optim.SGD(params, lr=0.1, momentum=0.8))
    return [p.grad.clone() for p in params]


for step in range(4):
    exchange_m(a, random_grads(step))
b = rule.bind(T, params)
b.load_state_dict(a.state_dict())
ga, gb = exchange_m(a, random_grads(99)), exchange_m(b, random_grads(99))
restored_equal["topk_momentum"] = {
    "next_step_equal": all(torch.equal(x, y) for x, y in zip(ga, gb)),
    "momentum": b.exchanger.momentum,
    "previous_nonzero": any(float(t.abs().sum()) > 0 for t in a.handoff.previous),
}
a.close()
b.close()
result["checkpoint"] = restored_equal

if RANK == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
