"""The BERT training logic: cross-entropy on the masked positions only. The architecture is passed in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from osdp_lightning.recipes.bert.model import Bert
from osdp_lightning.recipes.task import LanguageModelTask


class BertLitModule(LanguageModelTask):
    """Masked language modelling: recover the original token wherever ``labels`` is not -100."""

    def __init__(self, net: Bert, lr: float = 1e-3, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.999), warmup_steps: int = 10) -> None:
        super().__init__(net, lr=lr, weight_decay=weight_decay, betas=betas, warmup_steps=warmup_steps)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.net(batch["input_ids"])  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
