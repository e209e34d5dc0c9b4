"""A small Lightning project as a user writes it (BatchNorm, DDP on CPU), with ddpack's one-line change:
`callbacks=[DdpackCallback()]` (left out with DDPACK_ADAPTER=0, to see what Lightning alone does)."""

import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from faults import in_training_step

from ddpack_run.lightning import DdpackCallback


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        in_training_step(self.global_rank, self.global_step)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    y = x.sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    adapter = os.environ.get("DDPACK_ADAPTER", "1") == "1"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("DEVICES", "2")),
        num_nodes=int(os.environ.get("NODES", "1")),
        strategy="ddp",
        max_epochs=int(os.environ.get("EPOCHS", "3")),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[DdpackCallback()] if adapter else [],
    )
    trainer.fit(Regression(), loader)


if __name__ == "__main__":
    main()
