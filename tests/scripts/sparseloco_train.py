"""Run on W ranks: SparseLoCo's wire against one process (rank 0 writes argv[1]).

- ``exchange``: three rounds of the wire's exchange (``sparseloco_mean_steps``, β = 0.9) on every
  rank's own Δ, against one process that builds every rank's row in turn, sums them in rank order
  and divides each entry by the number of ranks that sent it: the mean and this rank's accumulator
  bitwise; and the mean against the per-chunk reference (tests/comm/test_sparseloco.py), to float32
  rounding; the ranks chose some entries apart (so the division by senders, not W, is exercised);
- ``diloco``: the rule's hooks (``DiLoCoRule(wire="sparseloco")``, no Lightning) on every rank's own
  batches, against one process that trains the W replicas and runs SparseLoCo's outer loop over
  them (each replica's accumulator, each entry's mean over the replicas that sent it, plain SGD):
  every rank's weights;
- ``trainer``: Streaming DiLoCo on the wire through the Trainer (fragments, overlap, mixing): every
  rank ends bitwise alike, with the bytes the wire's formula gives; and a run saved after its first
  epoch (an exchange in flight) and resumed ends bitwise where the straight run does.
"""
import os
import shutil
import sys
import tempfile
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diloco_train import COMM, RANK, W, digest, identical, max_diff, trainer_run  # noqa: E402

import lightning_mpi  # noqa: E402
from lightning_mpi.comm.engine import ExchangeScheduler  # noqa: E402
from lightning_mpi.comm.sparseloco import SparseLayout, SparseLoCoWire, SparseLoCoWorkspace, sparseloco_mean_steps  # noqa: E402
from lightning_mpi.comm.transport import Transport  # noqa: E402
from tests.comm.test_sparseloco import reference  # noqa: E402


def part_exchange(results):
    sizes, k, beta = [5000, 7, 4096], 16, 0.9
    sections = [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]
    n = sum(sizes)
    padded = n + (-n) % W
    layout = SparseLayout(SparseLoCoWire(k), sections, torch.device("cpu"))
    transport = Transport(COMM)
    work = SparseLoCoWorkspace(layout, W, torch.device("cpu"))
    scheduler = ExchangeScheduler(rank=RANK, size=W)
    mine = torch.zeros(padded)
    # one process: every rank's accumulator and row, in turn
    accumulators = [torch.zeros(padded) for _ in range(W)]
    bitwise, close, spread = True, True, True
    for round_ in range(3):
        deltas = [torch.zeros(padded) for _ in range(W)]
        for r in range(W):
            deltas[r][:n] = torch.randn(n, generator=torch.Generator().manual_seed(1000 * round_ + r))
        flat = deltas[RANK].clone()
        scheduler.start(sparseloco_mean_steps(transport, flat, work, mine, beta))
        scheduler.wait_all()
        mean, senders = torch.zeros(padded), torch.zeros(padded)
        sent_reference = torch.zeros(padded)
        for r in range(W):
            before = accumulators[r].mul(beta).add(deltas[r])
            sent, _ = reference(before[:n].clone(), sections, k)
            sent_reference[:n] += sent
            row = torch.zeros(layout.row_bytes, dtype=torch.uint8)
            accumulators[r].mul_(beta).add_(deltas[r])
            layout.encode_with_feedback_(accumulators[r], row)
            layout.scatter_add_(mean, row)
            senders[layout.unpack(row)[0]] += 1
        # each entry's mean over the ranks that sent it
        sent_by = senders > 0
        mean[sent_by] /= senders[sent_by]
        sent_reference[sent_by] /= senders[sent_by]
        bitwise &= torch.equal(flat, mean) and torch.equal(mine, accumulators[RANK])
        close &= torch.allclose(flat, sent_reference, rtol=1e-5, atol=1e-7)
        spread &= bool((senders[sent_by] < W).any())  # ranks chose some entries apart
    results["exchange"] = {"bitwise": bitwise, "reference": close, "spread": spread,
                           "identical": len(set(COMM.allgather(flat.sum().item()))) == 1}


def part_diloco(results):
    """DiLoCo's hooks on every rank against W replicas trained in one process."""
    from lightning_mpi.rules.diloco import DiLoCoRule

    period, steps, k, beta, lr = 3, 7, 2, 0.9, 0.8
    rule = DiLoCoRule(period=period, wire="sparseloco", topk_per_chunk=k, error_decay=beta, outer_lr=lr, outer_warmup=0)

    def batches(r):
        g = torch.Generator().manual_seed(50 + r)
        return [(torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)) for _ in range(steps)]

    torch.manual_seed(0)
    start = nn.Linear(3, 2).state_dict()
    net = nn.Linear(3, 2)
    net.load_state_dict(start)
    bound = rule.bind(Transport(COMM), list(net.parameters()))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    bound.on_train_start()
    for x, y in batches(RANK):
        opt.zero_grad()
        (net(x) - y).pow(2).mean().backward()
        assert bound.before_step(opt)
        opt.step()
        bound.after_step(opt)
    bound.on_train_end()
    bound.close()

    replicas = [nn.Linear(3, 2) for _ in range(W)]
    for replica in replicas:
        replica.load_state_dict(start)
    optimizers = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.5) for r in replicas]
    theta = torch.cat([p.detach().reshape(-1) for p in replicas[0].parameters()])
    sizes = [p.numel() for p in replicas[0].parameters()]
    sections = [(sum(sizes[:i]), s) for i, s in enumerate(sizes)]
    accumulators = [torch.zeros_like(theta) for _ in range(W)]

    def outer(step_lr):
        nonlocal theta
        mean, senders = torch.zeros_like(theta), torch.zeros_like(theta)
        for r, replica in enumerate(replicas):
            local = torch.cat([p.detach().reshape(-1) for p in replica.parameters()])
            accumulators[r].mul_(beta).add_(theta - local)
            sent, _ = reference(accumulators[r].clone(), sections, k)
            accumulators[r].sub_(sent)
            mean += sent
            senders += (sent != 0).float()
        theta = theta - step_lr * mean / senders.clamp(min=1)  # over the ranks that sent each entry
        for replica in replicas:
            with torch.no_grad():
                for p, t in zip(replica.parameters(), torch.split(theta, sizes)):
                    p.copy_(t.view_as(p))

    data = [batches(r) for r in range(W)]
    for step in range(steps):
        for replica, o, batch in zip(replicas, optimizers, data):
            x, y = batch[step]
            o.zero_grad()
            (replica(x) - y).pow(2).mean().backward()
            o.step()
        if (step + 1) % period == 0:
            outer(lr)
    outer(1.0)  # the end: the steps since the last outer step, averaged in
    diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(net.parameters(), replicas[0].parameters()))
    results["diloco"] = {"diff": diff, "identical": identical(net)}


def part_trainer(results):
    S = lightning_mpi

    def make():
        return S.StreamingDiLoCoStrategy(period=4, fragments=2, overlap_steps=1, wire="sparseloco", topk_per_chunk=8)

    streaming, strategy = trainer_run(make(), steps_per_epoch=8)
    stats = strategy.bound_rule.stats()
    sizes = [[p.numel() for p in f.local.bucket.tensors] for f in strategy.bound_rule.fragments]
    wire = SparseLoCoWire(8)
    results["trainer"] = {
        "identical": identical(streaming),
        "finite": all(bool(torch.isfinite(p).all()) for p in streaming.parameters()),
        "outer_steps": stats["outer_steps"],
        "bytes": stats["bytes_per_exchange"] == max(wire.exchange_bytes(s, W) for s in sizes),
    }
    directory = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    path = os.path.join(directory, "sparseloco.ckpt")
    # period 4, 6 steps an epoch: fragment 0's exchange started after step 6 is in flight at the save
    straight, _ = trainer_run(make(), steps_per_epoch=6, epochs=2, inner="adam", save_to=path)
    saved = torch.load(path, weights_only=False)["lightning_mpi"]["state"]
    resumed, _ = trainer_run(make(), steps_per_epoch=6, epochs=2, inner="adam", resume_from=path)
    results["resume"] = {
        "equal_on_every_rank": all(COMM.allgather(digest(straight) == digest(resumed))),
        "diff": max_diff(straight, resumed), "identical": identical(resumed),
        "in_flight_saved": [f["arrived"] is not None for f in saved["fragments"]],
        "accumulators_saved": all(r["residuals"][0] is not None for r in saved["ranks"]),
    }
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    import json

    results = {}
    part_exchange(results)
    part_diloco(results)
    part_trainer(results)
    if RANK == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
