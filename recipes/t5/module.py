"""The T5 training logic: teacher-forced cross-entropy on the target sequence. The architecture is passed in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from osdp_lightning.recipes.t5.model import T5
from osdp_lightning.recipes.task import LanguageModelTask
from osdp_lightning.recipes.text import PAD_ID


def shift_right(labels: torch.Tensor) -> torch.Tensor:
    """Decoder inputs: ``PAD_ID`` (T5's start token) followed by the labels, padding for -100."""
    start = torch.full_like(labels[:, :1], PAD_ID)  # (B, 1)
    shifted = torch.cat([start, labels[:, :-1]], dim=1)  # (B, T)
    return shifted.masked_fill(shifted == -100, PAD_ID)


class T5LitModule(LanguageModelTask):
    """Sequence to sequence: predict ``labels`` from ``input_ids``; -100 labels are ignored."""

    def __init__(self, net: T5, lr: float = 3e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.99), warmup_steps: int = 10) -> None:
        super().__init__(net, lr=lr, weight_decay=weight_decay, betas=betas, warmup_steps=warmup_steps)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]  # (B, T)
        logits = self.net(batch["input_ids"], batch["attention_mask"], shift_right(labels))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
