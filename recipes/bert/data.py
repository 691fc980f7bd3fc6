"""BERT data: byte windows with 15% of positions chosen for prediction (80% masked, 10% random, 10% kept)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from osdp_lightning.recipes.text import MASK_ID, TextWindowDataModule


class BertDataModule(TextWindowDataModule):
    """Batches ``{"input_ids": (B, T), "labels": (B, T)}``; labels are -100 where nothing is predicted."""

    def __init__(self, seq_len: int, batch_size: int, text_files: str | Sequence[str] | None = None,
                 val_fraction: float = 0.05, num_workers: int = 0, mask_prob: float = 0.15) -> None:
        super().__init__(seq_len, batch_size, text_files, val_fraction, num_workers)
        self.mask_prob = mask_prob

    def collate(self, windows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        tokens = torch.stack(windows)  # (B, T)
        chosen = torch.rand(tokens.shape) < self.mask_prob  # (B, T) positions to predict
        labels = torch.where(chosen, tokens, torch.full_like(tokens, -100))
        draw = torch.rand(tokens.shape)
        inputs = torch.where(chosen & (draw < 0.8), torch.full_like(tokens, MASK_ID), tokens)
        random_bytes = torch.randint_like(tokens, 0, 256)
        inputs = torch.where(chosen & (draw >= 0.8) & (draw < 0.9), random_bytes, inputs)
        return {"input_ids": inputs, "labels": labels}
