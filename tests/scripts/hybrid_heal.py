"""``mpi_hybrid`` losing a rank inside a replica, then a whole replica (a host), and healing
(``heal="shrink"``; tests/strategies/test_hybrid.py).

Usage: ``lightning-mpi --heal -n 4 hybrid_heal.py OUT_DIR`` (Open MPI with ULFM). Two Fabric loops
in one launch, each on ``HybridStrategy(group_size=2, fragments=1, overlap_steps=0, mix_alpha=0,
wire="fp32", period=PERIOD)``, the replicas being launch ranks {0, 1} and {2, 3}:

1. ``replica``: launch rank 3 dies at step KILL, before its backward (after a barrier, so that every
   rank completed the step before): its replica-mate finds the gradient exchange failed, replica 0
   finds the outer exchange of that step failed; the survivors heal (W 4 -> 3), replica 1 goes on
   with launch rank 2 alone, which now carries both pieces of its replica's Δ, and they finish STEPS.
2. ``host``: the three left, replicas {0, 1} and {2}; launch rank 2 (the whole of replica 1) dies at
   step KILL: replica 0 goes on alone (``min_ranks=2``), its outer steps on its own Δ.
3. ``replace``: the Trainer with ``heal="replace"`` (``min_ranks=1``) on the two left, one replica
   (``group_size=2``); launch rank 1 dies at step REPLACE_KILL; the survivor spawns a replacement,
   waits for it at the next batch and lets it in: the replacement (a spawned process) forms a replica
   of its own, from θ_global, and the two replicas train on to REPLACE_STEPS.
4. ``replace_host``: the same on those two with replicas by host name (one host: one replica of
   two); that replacement dies, and its own replacement joins the replica of the survivor, taking its
   weights and inner-optimizer state (SGD momentum).

A replacement records under REPLACEMENT + the index of the phase that spawned it (from 2).

Each rank picks its batch by its current rank and world size, and appends a record per step to
``OUT_DIR/steps.<launch rank>.jsonl``; the survivors of each phase write ``OUT_DIR/<phase>.<launch
rank>.json`` (initial and final weights, the heal history, the layout at the end).
"""

import json
import os
import signal
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
N, B, LR, PERIOD, KILL, STEPS = 48, 4, 0.1, 3, 5, 9
REPLACE_KILL, REPLACE_STEPS, REPLACEMENT = 1, 8, 10
OUT, RANK = Path("."), 0


def data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 6, generator=g)
    return x, x @ torch.randn(6, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def weights(net: nn.Module) -> list:
    return [p.detach().double().flatten().tolist() for p in net.parameters()]


def record(**entry) -> None:
    with open(OUT / f"steps.{RANK}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def phase(name: str, dies: int, **options) -> dict:
    import lightning as L

    import lightning_mpi.fabric

    strategy = lightning_mpi.fabric.HybridStrategy(
        group_size=2, fragments=1, overlap_steps=0, mix_alpha=0.0, wire="fp32", period=PERIOD, heal="shrink", **options
    )
    fabric = L.Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    net = make_net()
    initial = weights(net)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    x, y = data()
    for step in range(STEPS):
        if step == KILL:
            fabric.barrier()
            if RANK == dies:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        index = [(step * B * fabric.world_size + fabric.global_rank * B + k) % N for k in range(B)]
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x[index]), y[index]))
        opt.step()
        record(phase=name, step=step, world=fabric.world_size, indices=index)
    layout = strategy.bound_rule.layout
    ended = {"replicas": layout.replicas, "replica_size": layout.size, "pieces": layout.mine}
    strategy.finish_training()
    return {
        "initial": initial,
        "final": weights(net),
        "history": strategy._core.healing.history,
        "world_size": fabric.world_size,
        "layout": ended,
    }


def replace_phase(name: str, group_size: int | None, momentum: float) -> dict:
    import lightning as L

    import lightning_mpi.lightning

    x, y = data()

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def on_train_batch_start(self, batch, batch_idx):
            if self.global_step == REPLACE_KILL and self.global_rank == 1:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

        def training_step(self, batch, batch_idx):
            index = batch[0]
            record(phase=name, step=self.global_step, world=self.trainer.world_size, indices=index.tolist())
            return nn.functional.mse_loss(self.net(x[index]), y[index])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=momentum)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(N)), batch_size=B)

    strategy = lightning_mpi.lightning.HybridStrategy(
        group_size=group_size, fragments=1, overlap_steps=0, mix_alpha=0.0, wire="fp32", period=PERIOD, heal="replace",
        min_ranks=1,
    )
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=REPLACE_STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Net()
    trainer.fit(model)
    layout = strategy.bound_rule.layout
    return {
        "final": weights(model.net),
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "replaced": strategy._core.healing.replaced,
        "layout": {"replicas": layout.replicas, "replica_size": layout.size, "pieces": layout.mine},
    }


def main() -> None:
    global OUT, RANK
    from mpi4py import MPI

    from known_join import survivors_wait_for_the_join

    survivors_wait_for_the_join()
    OUT, RANK = Path(sys.argv[1]), MPI.COMM_WORLD.Get_rank()
    phases = (
        ("replica", lambda: phase("replica", 3)),
        ("host", lambda: phase("host", 2, min_ranks=2)),
        ("replace", lambda: replace_phase("replace", 2, 0.0)),
        ("replace_host", lambda: replace_phase("replace_host", None, 0.9)),
    )
    names = [name for name, _ in phases]
    if os.environ.get("LIGHTNING_MPI_REPLACEMENT"):  # a replacement starts at the phase that spawned it
        current = names.index((OUT / "phase").read_text())
        RANK, phases = REPLACEMENT + current, phases[current:]
    for name, run in phases:
        mark = OUT / f"phase.{os.getpid()}"  # what a replacement spawned in this phase reads (atomic)
        mark.write_text(name)
        os.replace(mark, OUT / "phase")
        result = run()
        (OUT / f"{name}.{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
