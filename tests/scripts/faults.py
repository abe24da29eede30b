"""Run on W ranks with a fault injected by argv[1]; the test checks how the job ends.

Modes: step (rank 1 raises in training_step), loader (rank 1's dataset raises), callback
(the last rank's callback raises), sigkill (rank 1 kills itself), stuck (rank 1 sleeps in
training_step while the others wait; collective_timeout=4), model (rank 1 builds another model).
"""
import os
import signal
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

warnings.filterwarnings("ignore")
import pytorch_lightning as pl  # noqa: E402
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402

MODE = sys.argv[1]
RANK, W = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


class Data(Dataset):
    def __len__(self):
        return 64 * W

    def __getitem__(self, i):
        if MODE == "loader" and RANK == 1 and i % W == 1 and torch.rand(1).item() < 2:  # noqa: PLR2004
            raise KeyError(f"corrupt sample {i} on rank {RANK}")
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randint(0, 2, (1,), generator=g).squeeze()


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        width = 17 if (MODE == "model" and RANK == 1) else 16
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2))

    def training_step(self, batch, i):
        if i == 3 and RANK == 1:
            if MODE == "step":
                raise RuntimeError(f"boom in training_step on rank {RANK}")
            if MODE == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if MODE == "stuck":
                time.sleep(600)
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Failing(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if MODE == "callback" and trainer.global_step == 2 and RANK == W - 1:
            raise ValueError(f"callback failed on rank {RANK}")


trainer = pl.Trainer(
    strategy=lightning_mpi.SyncStrategy(exchange="asa", collective_timeout=4.0),
    max_epochs=3,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[Failing()],
)
trainer.fit(Module(), DataLoader(Data(), batch_size=4))
print(f"rank {RANK} finished normally", flush=True)
