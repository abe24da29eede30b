"""A rank lost while Lightning sets the training loader up (tests/strategies/test_heal.py).

Usage: ``lightning-mpi --heal -n 3 heal_in_loader_setup.py OUT_DIR``. ``Trainer.fit`` on
``SyncStrategy(heal="shrink")``, 3 epochs of 60 samples in batches of 4, the training loader built
anew every epoch (``reload_dataloaders_every_n_epochs=1``). At the start of epoch 1, rank 2 passes the
loader's barrier and dies when Lightning reads the length of the loader it sharded: the survivors
find the loss in the reduce of the lengths that comes next, with the loader already sharded over 3
and handed to Lightning. Every training step is recorded in
``OUT_DIR/steps.<rank>.jsonl`` (epoch, world size, sample indices); every rank that ends writes
``OUT_DIR/end.<rank>.json`` (what heal_train.py's Trainer phases report: final weights, world size,
step, heal history). The data, model and Trainer are heal_train.py's.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from heal_train import LR, B, Indexed, _trainer_fit, die, make_net
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader

from lightning_mpi.lightning import SyncStrategy

EPOCHS, DIES = 3, 2
out = Path(sys.argv[1])
launch_rank = MPI.COMM_WORLD.Get_rank()
epochs_ended = 0


class Loader(DataLoader):
    """Lightning reads a loader's length after its barrier and after sharding it, just before the
    reduce of the lengths: rank DIES dies there at epoch 1."""

    def __len__(self) -> int:
        if epochs_ended == 1 and launch_rank == DIES:
            die()
        return super().__len__()


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        entry = {"epoch": self.current_epoch, "world": self.trainer.world_size, "indices": index.tolist()}
        with open(out / f"steps.{launch_rank}.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_epoch_end(self):
        global epochs_ended
        epochs_ended += 1

    def train_dataloader(self):
        return Loader(Indexed(), batch_size=B, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


strategy = SyncStrategy(heal="shrink")
end = _trainer_fit(Net(), strategy, max_epochs=EPOCHS, reload_dataloaders_every_n_epochs=1, enable_checkpointing=False)
(out / f"end.{launch_rank}.json").write_text(json.dumps(end))
