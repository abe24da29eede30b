"""Run on 4 ranks: ``mpi_hybrid`` (2 replicas of 2 ranks, ``group_size=2``) through the Trainer and
Fabric; rank 0 writes the results to argv[1] (and, with argv[2], leaves a checkpoint there for a run
at another world size: ``resume_other``).

- ``replay``: DiLoCo across replicas (one fragment, τ = 0, α = 0, fp32) against one process that
  trains two replicas, each on the mean of its two ranks' gradients, with the outer steps of a
  2-worker DiLoCo; and model averaging of the replicas (``outer_lr=1, outer_momentum=0``);
- ``replay_sparse``: the same on SparseLoCo's wire (``wire="sparseloco"``: plain outer SGD at rate 1)
  against one process that keeps, per replica and piece, the carrier's decaying accumulator and
  averages the pieces' sparse rows as the wire does;
- ``flat``: ``group_size=1`` (one rank per replica) against ``mpi_streaming_diloco``, bitwise;
- ``bytes``: what a rank sends across replicas per exchange, 2 × 2 against flat over 4 ranks;
- ``resume``: 2 epochs straight (saving after the first, an exchange in flight) against the second
  resumed from that checkpoint, per rank, bitwise (Streaming, int4, Adam);
- ``fabric``: a Fabric run under the registered name with ``LIGHTNING_MPI_RANKS_PER_NODE=2``;
- ``zero``: ZeRO inside the replicas (``inner_exchange="zero"``, Adam) against the same run with ASA
  inside, bitwise; each rank holds half of its replica's Adam state; a save after ``fit`` is a sharded
  checkpoint whose consolidation holds replica 0's whole Adam state (the ASA run's rank 0's); a save
  during ``fit`` holds rank 0's weights, not a mix of the replicas'; and 2 epochs straight against the
  second resumed from the sharded save after the first, per rank.

With argv[2] = ``resume_other`` and 2 ranks: resume the 4-rank checkpoint at ``group_size=1`` (two
replicas of one rank): each replica starts from its saved weights.
"""
import copy
import hashlib
import json
import os
import sys
import tempfile
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
from mpi4py import MPI  # noqa: E402
from tiny_task import dataset, make_net  # noqa: E402  (beside this script)

import lightning_mpi  # noqa: E402
from lightning_mpi.rules.diloco.outer import make_outer_optimizer, outer_step_  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
B, LR = 4, 0.1


def digest(module):
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()


def identical(module):
    return len(set(COMM.allgather(digest(module)))) == 1


def indexed(n):
    x, y = dataset(n).tensors
    return TensorDataset(x, y, torch.arange(n))


def trainer_run(strategy, steps_per_epoch=8, epochs=1, inner="sgd", save_to=None, resume_from=None, save_after=None):
    """Train ``tiny_task``'s net (``save_after``: ``trainer.save_checkpoint`` there after ``fit``);
    return (module, strategy, the sample indices of each step)."""
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net()
            self.seen = []

        def training_step(self, batch, _):
            x, y, index = batch
            if not self.seen:  # the weights the first step starts from (after a resume: the restored ones)
                self.first = flat(self.parameters()).clone()
            self.seen.append(index.tolist())
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            if inner == "adam":
                return torch.optim.Adam(self.parameters(), lr=0.01)
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    class Initial(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.initial = copy.deepcopy(pl_module.net.state_dict())

    class SaveAtEpochEnd(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if save_to is not None and trainer.current_epoch == 0:
                trainer.save_checkpoint(save_to)

    torch.manual_seed(100 + RANK)  # different initial weights: setup must broadcast rank 0's
    model = Module()
    trainer = pl.Trainer(strategy=strategy, max_epochs=epochs, callbacks=[Initial(), SaveAtEpochEnd()], **QUIET)
    loader = DataLoader(indexed(W * B * steps_per_epoch), batch_size=B, shuffle=True)
    trainer.fit(model, loader, ckpt_path=resume_from)
    if save_after is not None:
        trainer.save_checkpoint(save_after)
    return model, trainer.strategy, COMM.allgather(model.seen)


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def replay(initial, seen, replicas, period, outer_lr, outer_momentum, warmup=1, mean=None):
    """One process: every replica trains its own net (SGD, momentum 0.9) on the mean of its ranks'
    gradients (each rank's batch its own mean loss, as the ranks compute it); after every ``period``
    steps Δ_r = θ_global − θ_r is averaged over the replicas, the first ``warmup`` outer steps
    average (θ_global − mean Δ), the others take an outer Nesterov step, and every replica restarts
    from θ_global; the end folds the last steps in by averaging. ``mean(deltas)``: how the replicas'
    Δ are averaged (default: their mean). Returns θ_global."""
    x, y, _ = indexed(W * B * len(seen[0])).tensors
    nets = []
    for _ in replicas:
        net = make_net()
        net.load_state_dict(initial)
        nets.append(net)
    opts = [torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9) for net in nets]
    theta = flat(nets[0].parameters()).clone()
    outer = make_outer_optimizer([theta], outer_lr, outer_momentum)
    count = 0

    def mean_delta():
        deltas = [theta - flat(net.parameters()) for net in nets]
        return (deltas[0] + deltas[1]) / 2 if mean is None else mean(deltas)

    def restart():
        for net in nets:
            torch.nn.utils.vector_to_parameters(theta.clone(), net.parameters())

    steps = len(seen[0])
    for step in range(steps):
        for net, opt, members in zip(nets, opts, replicas, strict=True):
            grads = []
            for rank in members:
                net.zero_grad()
                index = torch.tensor(seen[rank][step])
                nn.functional.cross_entropy(net(x[index]), y[index]).backward()
                grads.append([p.grad.clone() for p in net.parameters()])
            for p, g0, g1 in zip(net.parameters(), *grads, strict=True):
                p.grad = (g0 + g1) / 2
            opt.step()
        if (step + 1) % period == 0:
            count += 1
            with torch.no_grad():
                if count <= warmup:
                    theta.sub_(mean_delta())
                else:
                    outer_step_(outer, theta, mean_delta())
                restart()
    if steps % period:
        with torch.no_grad():
            theta.sub_(mean_delta())
    return theta


def part_replay(results):
    H = lightning_mpi.HybridStrategy
    for name, (lr, momentum) in (("diloco", (0.7, 0.9)), ("model_avg", (1.0, 0.0))):
        strategy = H(group_size=2, period=3, fragments=1, overlap_steps=0, mix_alpha=0.0, wire="fp32",
                     outer_lr=lr, outer_momentum=momentum)
        model, strategy, seen = trainer_run(strategy)
        expected = replay(model.initial, seen, [[0, 1], [2, 3]], 3, lr, momentum)
        stats = strategy.bound_rule.stats()
        results[f"replay_{name}"] = {
            "diff": (flat(model.parameters()) - expected).abs().max().item(),
            "identical": identical(model), "outer_steps": stats["outer_steps"],
            "replicas": stats["replicas"], "replica_size": stats["replica_size"],
        }


def sparse_mean(pieces, k, beta):
    """The mean of the replicas' Δ on SparseLoCo's wire as mpi_hybrid takes it, in one process: Δ
    padded and cut into ``pieces`` rows, each row's real entries one section; per replica and piece
    a decaying accumulator (its carrier's), the rows' values summed in replica order and each entry
    divided by the replicas that sent it."""
    from lightning_mpi.comm.sparseloco import SparseLayout, SparseLoCoWire

    accumulators = {}

    def mean(deltas):
        numel = deltas[0].numel()
        length = -(-numel // (pieces * len(deltas))) * len(deltas)  # padded to pieces × replicas
        out = torch.zeros(pieces * length)
        for p in range(pieces):
            real = max(0, min(length, numel - p * length))
            layout = SparseLayout(SparseLoCoWire(k), [(0, real)], torch.device("cpu"))
            row, sent = out[p * length : (p + 1) * length], []
            rows = []
            for r, delta in enumerate(deltas):
                padded = torch.zeros(pieces * length)
                padded[:numel] = delta
                e = accumulators.setdefault((r, p), torch.zeros(length))
                e.mul_(beta).add_(padded[p * length : (p + 1) * length])
                rows.append(torch.zeros(layout.row_bytes, dtype=torch.uint8))
                layout.encode_with_feedback_(e, rows[-1])
            for packed in rows:
                at, value = layout.unpack(packed)
                row.index_add_(0, at, value)
                sent.append(at)
            touched, senders = torch.unique(torch.cat(sent), return_counts=True)
            row[touched] /= senders.to(row.dtype)
        return out[:numel]

    return mean


def part_sparse(results):
    k, beta = 1024, 0.8  # pieces of 114 and 113 entries: 29 of each sent
    strategy = lightning_mpi.HybridStrategy(group_size=2, period=3, fragments=1, overlap_steps=0, mix_alpha=0.0,
                                            wire="sparseloco", topk_per_chunk=k, error_decay=beta)
    model, strategy, seen = trainer_run(strategy)
    expected = replay(model.initial, seen, [[0, 1], [2, 3]], 3, 1.0, 0.0, mean=sparse_mean(2, k, beta))
    stats = strategy.bound_rule.stats()
    results["replay_sparse"] = {
        "diff": (flat(model.parameters()) - expected).abs().max().item(),
        "identical": identical(model), "outer_steps": stats["outer_steps"],
        "bytes_per_exchange": COMM.allgather(stats["bytes_per_exchange"]),
    }


def part_flat(results):
    S = lightning_mpi
    kwargs = dict(period=4, fragments=2, overlap_steps=1, wire="int8")
    hybrid, strategy, _ = trainer_run(S.HybridStrategy(group_size=1, **kwargs))
    streaming, _, _ = trainer_run(S.StreamingDiLoCoStrategy(**kwargs))
    results["flat"] = {
        "diff": (flat(hybrid.parameters()) - flat(streaming.parameters())).abs().max().item(),
        "identical": identical(hybrid), "replicas": strategy.bound_rule.stats()["replicas"],
        "bytes_per_exchange": strategy.bound_rule.stats()["bytes_per_exchange"],
    }
    _, strategy, _ = trainer_run(S.HybridStrategy(group_size=2, **kwargs), steps_per_epoch=4)
    results["bytes"] = {"two_by_two": strategy.bound_rule.stats()["bytes_per_exchange"],
                        "flat": results["flat"]["bytes_per_exchange"]}


def part_resume(results, keep=None):
    directory = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    path = os.path.join(directory, "hybrid.ckpt")

    def make():
        # fragments exchange after steps 2, 6, 10 and 4, 8, 12 (period 4, 2 fragments); with τ = 1 the
        # exchange fragment 0 started at step 6 is in flight at the save after epoch 1 (6 steps)
        return lightning_mpi.HybridStrategy(group_size=2, period=4, fragments=2, overlap_steps=1, wire="int4")

    straight, _, _ = trainer_run(make(), steps_per_epoch=6, epochs=2, inner="adam", save_to=path)
    saved = torch.load(path, weights_only=False)["lightning_mpi"]["state"]
    resumed, _, _ = trainer_run(make(), steps_per_epoch=6, epochs=2, inner="adam", resume_from=path)
    results["resume"] = {
        "equal_on_every_rank": all(COMM.allgather(digest(straight) == digest(resumed))),
        "identical": identical(resumed), "saved_steps": saved["steps"],
        "in_flight_saved": [f["arrived"] is not None for f in saved["fragments"]],
        "replicas_saved": len(saved["replicas"]), "ranks_saved": len(saved["ranks"]),
    }
    if keep is not None and RANK == 0:
        import shutil

        shutil.copy(path, keep)


def part_fabric(results):
    import lightning as L

    os.environ["LIGHTNING_MPI_RANKS_PER_NODE"] = "2"  # fake hosts of 2 ranks, for the registered name
    try:
        fabric = L.Fabric(strategy="mpi_hybrid", accelerator="cpu")
        fabric.launch()
        torch.manual_seed(100 + RANK)
        net = make_net()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
        loader = fabric.setup_dataloaders(DataLoader(dataset(W * B * 10), batch_size=B, shuffle=True))
        for x, y in loader:
            fabric.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        stats = fabric.strategy.bound_rule.stats()
        fabric.strategy.finish_training()
    finally:
        del os.environ["LIGHTNING_MPI_RANKS_PER_NODE"]
    results["fabric"] = {
        "identical": identical(net), "replicas": stats["replicas"], "outer_steps": stats["outer_steps"],
        "class": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__,
    }


def part_zero(results):
    from lightning_mpi.checkpoint import consolidate_checkpoint, is_sharded_checkpoint

    directory = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    after, epoch = os.path.join(directory, "after.ckpt"), os.path.join(directory, "epoch.ckpt")

    def make(inner_exchange):
        return lightning_mpi.HybridStrategy(group_size=2, period=4, fragments=2, overlap_steps=1, wire="int4",
                                            inner_exchange=inner_exchange)

    asa, asa_strategy, _ = trainer_run(make("asa"), steps_per_epoch=6, epochs=2, inner="adam")
    zero, strategy, _ = trainer_run(make("zero"), steps_per_epoch=6, epochs=2, inner="adam", save_to=epoch,
                                    save_after=after)
    resumed, _, _ = trainer_run(make("zero"), steps_per_epoch=6, epochs=2, inner="adam", resume_from=epoch)
    full_adam = asa_strategy.optimizers[0].state_dict()  # rank 0's, replica 0's: whole tensors
    mine = strategy.optimizers[0].state_dict()["state"]
    held = sum(v.numel() for st in mine.values() for k, v in st.items() if k != "step")
    whole = sum(v.numel() for st in full_adam["state"].values() for k, v in st.items() if k != "step")
    results["zero"] = {
        "diff": (flat(zero.parameters()) - flat(asa.parameters())).abs().max().item(),
        "identical": identical(zero), "share_held": COMM.allgather(held / whole),
        "sharded": is_sharded_checkpoint(after),
        "resumed_equal_on_every_rank": all(COMM.allgather(digest(zero) == digest(resumed))),
    }
    if RANK == 0:
        plain = consolidate_checkpoint(after)["optimizer_states"][0]
        results["zero"]["consolidated_diff"] = max(
            (plain["state"][i][k] - v).abs().max().item()
            for i, st in full_adam["state"].items() for k, v in st.items() if k != "step"
        )
        results["zero"]["consolidated_shapes"] = all(
            plain["state"][i][k].shape == v.shape for i, st in full_adam["state"].items() for k, v in st.items()
        )
        # a save during fit, while the replicas differ, holds rank 0's weights (replica 0's), not a mix
        during = consolidate_checkpoint(epoch)
        replica0 = torch.cat(during["lightning_mpi"]["state"]["replicas"][0]["weights"])
        replica1 = torch.cat(during["lightning_mpi"]["state"]["replicas"][1]["weights"])
        weights = flat(during["state_dict"].values())
        results["zero"]["during_fit_rank0_weights"] = bool(torch.equal(weights, replica0))
        results["zero"]["replicas_differed"] = not torch.equal(replica0, replica1)


def resume_other(path, results):
    """2 ranks, one per replica: each replica starts from the weights its replica saved on 4 ranks."""
    saved = torch.load(path, weights_only=False)["lightning_mpi"]["state"]
    model, strategy, _ = trainer_run(lightning_mpi.HybridStrategy(group_size=1, period=4, fragments=2,
                                                                  overlap_steps=1, wire="int4"),
                                     steps_per_epoch=6, epochs=2, inner="adam", resume_from=path)
    mine = torch.cat(saved["replicas"][RANK]["weights"])
    results["resume_other"] = {
        "replicas": strategy.bound_rule.stats()["replicas"], "identical": identical(model),
        "saved_replicas": len(saved["replicas"]), "steps": strategy.bound_rule.steps,
        # the first step after the resume starts from the weights this rank's replica saved
        "from_saved_replica": all(COMM.allgather(bool(torch.equal(model.first, mine)))),
        "replicas_differed": bool(not torch.equal(*[torch.cat(r["weights"]) for r in saved["replicas"]])),
    }


if __name__ == "__main__":
    results = {}
    if len(sys.argv) > 2 and sys.argv[2] == "resume_other":
        resume_other(sys.argv[3], results)
    else:
        part_replay(results)
        part_sparse(results)
        part_flat(results)
        part_resume(results, keep=sys.argv[2] if len(sys.argv) > 2 else None)
        part_fabric(results)
        part_zero(results)
    if RANK == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
