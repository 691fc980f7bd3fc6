"""The GPT training logic: next-token cross-entropy. The architecture is passed in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from osdp_lightning.recipes.gpt.model import GPT
from osdp_lightning.recipes.task import LanguageModelTask


class GPTLitModule(LanguageModelTask):
    """Causal language modelling: predict token t+1 from tokens 0..t."""

    def __init__(self, net: GPT, lr: float = 1e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 10) -> None:
        super().__init__(net, lr=lr, weight_decay=weight_decay, betas=betas, warmup_steps=warmup_steps)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.net(batch["input_ids"])  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
