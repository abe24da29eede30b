"""Run on W ranks: lightning_mpi under ``L.Fabric``, compared with one process.

``python fabric_train.py OUT.json PART[,PART...]`` (rank 0 writes OUT.json: each PART's results
under its name; several parts share one launch). PART is one of:

- ``equivalence``: for each synchronous name, W ranks x batch B equal one process x batch W·B
  (the ranks start from different random weights: setup must broadcast rank 0's), also with
  ``fabric.no_backward_sync`` accumulation over 2 micro-batches;
- ``every_name``: every registered name trains, ``strategy.finish_training()`` ends it, and the
  ranks hold identical weights;
- ``collectives``: ``fabric.all_reduce`` / ``all_gather`` / ``broadcast`` / ``barrier``;
- ``resume``: a run saved at step K with ``fabric.save`` and resumed with ``fabric.load`` ends
  on exactly the weights of the uninterrupted run (rules with state: residuals, center).
"""
import hashlib
import json
import os
import sys
import tempfile
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

warnings.filterwarnings("ignore")
import lightning as L  # noqa: E402
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402
from tiny_task import dataset, make_net  # noqa: E402  (beside this script)

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
B, STEPS, LR = 4, 6, 0.2
SYNC = ("mpi_allreduce", "mpi_asa", "mpi_asa16", "mpi_asa_bf16")


def weights_digest(net):
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()


def fabric_for(strategy):
    fabric = L.Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    return fabric


def setup(fabric, seed=100):
    torch.manual_seed(seed + RANK)  # a different initialisation on every rank
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model, opt = fabric.setup(net, opt)
    return net, model, opt


def reference(initial, batch, steps):
    """One process, batch W·B (times accumulation), the samples of all ranks in order."""
    net = make_net()
    net.load_state_dict(initial)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    # Fabric's DistributedSampler(shuffle=False): rank r reads r, r+W, ..., so step k of all ranks
    # together covers samples [k·W·B, (k+1)·W·B).
    for x, y in DataLoader(dataset(batch * steps), batch_size=batch, shuffle=False):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.state_dict()


def train_equivalence(name, accumulate):
    fabric = fabric_for(name)
    net, model, opt = setup(fabric)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    loader = fabric.setup_dataloaders(DataLoader(dataset(W * B * STEPS * accumulate), batch_size=B, shuffle=False))
    mismatches = 0
    for index, (x, y) in enumerate(loader):
        last = (index + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            fabric.backward(nn.functional.cross_entropy(model(x), y) / accumulate)
        if last:
            opt.step()
            opt.zero_grad()
            mismatches += len(set(COMM.allgather(weights_digest(net)))) != 1
    fabric.strategy.finish_training()
    ref = reference(initial, W * B * accumulate, STEPS)
    diff = max((net.state_dict()[k] - ref[k]).abs().max().item() for k in ref)
    return {"diff": diff, "mismatches": mismatches, "steps": len(loader) // accumulate}


def part_equivalence():
    results = {name: train_equivalence(name, 1) for name in SYNC}
    results["mpi_allreduce+accumulate2"] = train_equivalence("mpi_allreduce", 2)
    results["mpi_asa16+accumulate2"] = train_equivalence("mpi_asa16", 2)
    return results


def part_every_name():
    results = {}
    for name in lightning_mpi.STRATEGIES:
        fabric = fabric_for(name)
        net, model, opt = setup(fabric)
        loader = fabric.setup_dataloaders(DataLoader(dataset(W * B * 16), batch_size=B, shuffle=True))
        losses = []
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        fabric.strategy.finish_training()
        digests = COMM.allgather(weights_digest(net))
        finite = all(torch.isfinite(p).all() for p in net.parameters())
        results[name] = {"identical": len(set(digests)) == 1, "finite": bool(finite), "steps": len(losses),
                         "class": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__}
    return results


def part_collectives():
    fabric = fabric_for("mpi_allreduce")
    mean = fabric.all_reduce(torch.tensor([float(RANK), 1.0]))
    total = fabric.all_reduce(torch.tensor(float(RANK)), reduce_op="sum")
    gathered = fabric.all_gather(torch.tensor([RANK, 10 * RANK]))
    obj = fabric.broadcast({"from": RANK}, src=W - 1)
    fabric.barrier("end")
    decision = fabric.strategy.reduce_boolean_decision(RANK == 0, all=False)
    return {"mean": mean.tolist(), "sum": total.item(), "gathered": gathered.tolist(), "broadcast": obj,
            "any_rank_zero": decision, "world_size": fabric.world_size, "global_rank0": fabric.global_rank == 0}


def same(a, b):
    """Equal rule states: tensors bitwise, containers element by element, the rest by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def train_resumable(name, path, save_at, resume):
    """Train STEPS*2 steps; save at ``save_at`` (or resume from ``path`` there)."""
    fabric = fabric_for(name)
    net, model, opt = setup(fabric, seed=7)
    loader = DataLoader(dataset(W * B * STEPS * 2), batch_size=B, shuffle=False)
    loader = fabric.setup_dataloaders(loader)
    state = {"model": model, "optimizer": opt, "step": 0}
    restored = None
    if resume:
        fabric.load(path, state)
        restored = fabric.strategy.bound_rule.state_dict()
    for step, (x, y) in enumerate(loader):
        if step < state["step"]:
            continue  # the resumed run skips what the checkpoint already holds (same data order)
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        if not resume and step + 1 == save_at:
            state["step"] = step + 1
            fabric.save(path, state)
    fabric.strategy.finish_training()
    return weights_digest(net), {k: v.clone() for k, v in net.state_dict().items()}, restored


def part_resume():
    results = {}
    directory = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    # Saved at step 4: a model-averaging boundary (period 4), where every rank holds the same
    # weights. Between exchanges the local-step rules' ranks differ, and a checkpoint keeps rank
    # 0's local weights and the rule's state (center, clocks), not every rank's local weights.
    for name in ("mpi_allreduce", "mpi_asa_int8", "mpi_topk", "mpi_model_avg", "mpi_easgd"):
        path = os.path.join(directory, f"{name}.ckpt")
        digest_full, full, _ = train_resumable(name, path, save_at=4, resume=False)
        digest_resumed, resumed, restored = train_resumable(name, path, save_at=4, resume=True)
        saved = torch.load(path, weights_only=False)["lightning_mpi"]["state"]
        results[name] = {
            "equal": digest_full == digest_resumed,
            "diff": max((full[k] - resumed[k]).abs().max().item() for k in full),
            "rule_state_restored": same(saved, restored),
        }
    return results


if __name__ == "__main__":
    out, parts = sys.argv[1], sys.argv[2].split(",")
    run = {"equivalence": part_equivalence, "every_name": part_every_name, "collectives": part_collectives,
           "resume": part_resume}
    result = {part: run[part]() for part in parts}
    if RANK == 0:
        with open(out, "w") as f:
            json.dump(result, f)
