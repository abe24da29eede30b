"""The LightningModule the ZeRO checkpoint tests save and load (imported from beside them).

It imports only torch and Lightning, so a process that loads a consolidated checkpoint into it
shows whether that needs lightning_mpi."""
import pytorch_lightning as pl
import torch
from torch import nn


class ZeroNet(pl.LightningModule):
    """Odd sizes (chunks cut parameters apart), a 0-dim parameter and a frozen one."""

    def __init__(self, hidden: int = 13) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.a = nn.Linear(7, hidden)
        self.b = nn.Linear(hidden, 5)
        self.scale = nn.Parameter(torch.tensor(1.3))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale + self.frozen.sum()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            [{"params": list(self.a.parameters()) + [self.frozen], "lr": 3e-2, "weight_decay": 0.1},
             {"params": list(self.b.parameters()) + [self.scale], "lr": 5e-3}],
            lr=1e-2, weight_decay=0.01,
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return [optimizer], [scheduler]
