"""T5 data: span corruption of text (T5's pre-training objective) or generated seq2seq tasks.

Span corruption drops about ``noise_density`` of each byte window in spans of mean length
``mean_span_len``; the encoder sees the window with each span replaced by a sentinel id, the
decoder writes out every sentinel followed by the bytes it hid:

    window  "The quick brown fox"
    input   "The qu<s0> brown<s1>x</s>"
    target  "<s0>ick<s1> fo</s>"

Every window of one length drops the same number of bytes in the same number of spans, so all
samples have the same input and target lengths and need no padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from osdp_lightning.recipes.text import EOS_ID, FIRST_SENTINEL_ID, NUM_SENTINELS, TextWindowDataModule


def random_segment_lengths(total: int, parts: int) -> list[int]:
    """``parts`` random positive lengths that add up to ``total``."""
    cuts = (torch.randperm(total - 1)[: parts - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def span_counts(length: int, noise_density: float, mean_span_len: float) -> tuple[int, int]:
    """``(noise tokens, spans)`` for a window of ``length`` tokens."""
    num_noise = min(max(1, round(length * noise_density)), length - 1)
    num_spans = max(1, min(round(num_noise / mean_span_len), num_noise, length - num_noise))
    return num_noise, num_spans


def corrupt_spans(tokens: torch.Tensor, noise_density: float, mean_span_len: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, target)`` of one window (both 1-D, ending with ``EOS_ID``)."""
    num_noise, num_spans = span_counts(len(tokens), noise_density, mean_span_len)
    noise_lengths = random_segment_lengths(num_noise, num_spans)
    keep_lengths = random_segment_lengths(len(tokens) - num_noise, num_spans)
    inputs, targets, start = [], [], 0
    for i, (keep, noise) in enumerate(zip(keep_lengths, noise_lengths, strict=True)):
        sentinel = torch.tensor([FIRST_SENTINEL_ID + i])
        inputs += [tokens[start : start + keep], sentinel]
        targets += [sentinel, tokens[start + keep : start + keep + noise]]
        start += keep + noise
    eos = torch.tensor([EOS_ID])
    return torch.cat([*inputs, eos]), torch.cat([*targets, eos])


class T5SpanCorruptionDataModule(TextWindowDataModule):
    """Batches ``{"input_ids": (B, S), "attention_mask": (B, S), "labels": (B, T)}`` from text windows."""

    def __init__(self, seq_len: int, batch_size: int, text_files: str | Sequence[str] | None = None,
                 val_fraction: float = 0.05, num_workers: int = 0, noise_density: float = 0.15,
                 mean_span_len: float = 3.0) -> None:
        super().__init__(seq_len, batch_size, text_files, val_fraction, num_workers)
        self.noise_density = noise_density
        self.mean_span_len = mean_span_len
        num_noise, num_spans = span_counts(seq_len, noise_density, mean_span_len)
        if num_spans > NUM_SENTINELS:
            raise ValueError(f"seq_len={seq_len} needs {num_spans} sentinels; there are {NUM_SENTINELS}:"
                             " raise mean_span_len or lower seq_len")
        self.input_len = seq_len - num_noise + num_spans + 1
        self.target_len = num_noise + num_spans + 1

    @property
    def tokens_per_sample(self) -> int:
        return self.input_len + self.target_len

    def collate(self, windows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        pairs = [corrupt_spans(w, self.noise_density, self.mean_span_len) for w in windows]
        inputs = torch.stack([p[0] for p in pairs])  # (B, S)
        return {"input_ids": inputs, "attention_mask": torch.ones_like(inputs, dtype=torch.bool),
                "labels": torch.stack([p[1] for p in pairs])}  # (B, T)
