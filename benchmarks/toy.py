"""A small LightningModule for the benchmarks that need one (soak, exit_soak): a ReLU MLP on
random regression data, plain Adam. (The test suite's toy models live in tests/scripts, which a
benchmark does not import.)"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MLP(L.LightningModule):
    def __init__(self, width: int = 256, depth: int = 4, batch_size: int = 8, samples: int = 256) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        self.width, self.batch_size, self.samples = width, batch_size, samples

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(self.samples, self.width, generator=g)
        return DataLoader(TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True)), batch_size=self.batch_size,
                          shuffle=True, generator=torch.Generator().manual_seed(7))
