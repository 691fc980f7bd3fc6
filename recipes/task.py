"""What every recipe's LightningModule shares: loss logging and the AdamW + warmup-cosine optimizer.

The architecture (a plain ``nn.Module``) is passed in as ``net``; a recipe's subclass only says how
a batch becomes a loss (:meth:`LanguageModelTask.compute_loss`). Nothing here knows about
sharding: the strategy wraps ``net`` before :meth:`configure_optimizers` runs, so the optimizer
sees the sharded parameters.
"""

from __future__ import annotations

import functools
import math

import lightning.pytorch as pl
import torch
from torch import nn


class LanguageModelTask(pl.LightningModule):
    """Train ``net`` with AdamW, linear warm-up then cosine decay to 10% of ``lr`` at ``max_steps``."""

    def __init__(self, net: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.net = net

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy of the batch (a scalar); overridden by each recipe."""
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        data_vocab = getattr(datamodule, "vocab_size", None)
        model_vocab = self.net.config.vocab_size
        if data_vocab is not None and data_vocab > model_vocab:
            raise ValueError(f"the data has {data_vocab} token ids but the model's vocab_size is {model_vocab}")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.compute_loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict:
        # NOTE: weight decay applies to matrices only (not to biases, norms or gains).
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas))
        total_steps = self._total_steps()
        factor = functools.partial(warmup_cosine, warmup_steps=self.hparams.warmup_steps, total_steps=total_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> float:
        # NOTE: no trainer when osdp-plan builds the optimizer only to learn its state size.
        trainer = self._trainer
        if trainer is None:
            return float("inf")
        return trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches


def warmup_cosine(step: int, warmup_steps: int, total_steps: float) -> float:
    """Learning-rate factor: linear warm-up to 1, then cosine decay to 0.1 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if math.isinf(total_steps):
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1.0, total_steps - warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
