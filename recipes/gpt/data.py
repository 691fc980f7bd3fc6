"""GPT data: windows of ``seq_len + 1`` bytes; the input is the first ``seq_len``, the labels the last."""

from __future__ import annotations

import torch
from osdp_lightning.recipes.text import TextWindowDataModule


class GPTDataModule(TextWindowDataModule):
    """Batches ``{"input_ids": (B, T), "labels": (B, T)}`` with labels shifted one token left."""

    @property
    def window_len(self) -> int:
        return self.seq_len + 1

    def collate(self, windows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = torch.stack(windows)  # (B, T + 1)
        return {"input_ids": batch[:, :-1], "labels": batch[:, 1:]}
