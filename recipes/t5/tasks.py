"""Generated sequence-to-sequence tasks for T5: structure to learn, nothing to download.

Each sample is a task prefix and a random payload, with the answer as target::

    "copy: qzkfa"        -> "qzkfa"
    "reverse: qzkfa"     -> "afkzq"
    "sort: 40913"        -> "01349"
    "add: 4093+718"      -> "4811"

Samples are a pure function of (seed, index), so every rank and every run sees the same data.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence

import lightning.pytorch as pl
import torch
from osdp_lightning.recipes.text import EOS_ID, PAD_ID, VOCAB_SIZE, encode
from torch.utils.data import DataLoader, Dataset


def _copy(rng: random.Random, n: int) -> tuple[str, str]:
    s = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, n)))
    return s, s


def _reverse(rng: random.Random, n: int) -> tuple[str, str]:
    s = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, n)))
    return s, s[::-1]


def _sort(rng: random.Random, n: int) -> tuple[str, str]:
    s = "".join(rng.choices(string.digits, k=rng.randint(1, n)))
    return s, "".join(sorted(s))


def _add(rng: random.Random, n: int) -> tuple[str, str]:
    digits = max(1, (n - 1) // 2)
    a, b = rng.randrange(10 ** rng.randint(1, digits)), rng.randrange(10 ** rng.randint(1, digits))
    return f"{a}+{b}", str(a + b)


TASKS: dict[str, Callable[[random.Random, int], tuple[str, str]]] = {
    "copy": _copy, "reverse": _reverse, "sort": _sort, "add": _add,
}


class TaskDataset(Dataset):
    """``num_samples`` padded (input, attention mask, labels) triples drawn from ``tasks``."""

    def __init__(self, tasks: Sequence[str], max_len: int, num_samples: int, seed: int) -> None:
        unknown = sorted(set(tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"unknown tasks {unknown}; available: {sorted(TASKS)}")
        self.tasks, self.max_len, self.num_samples, self.seed = list(tasks), max_len, num_samples, seed
        self.input_len = max(len(t) for t in self.tasks) + 2 + max_len + 1  # "name: " + payload + EOS
        self.target_len = max_len + 1  # sums of two (max_len - 1) // 2 digit numbers fit in max_len

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = random.Random(self.seed * 1_000_003 + index)
        task = self.tasks[index % len(self.tasks)]
        payload, answer = TASKS[task](rng, self.max_len)
        source = torch.cat([encode(f"{task}: {payload}"), torch.tensor([EOS_ID])])
        target = torch.cat([encode(answer), torch.tensor([EOS_ID])])
        input_ids = torch.full((self.input_len,), PAD_ID)
        input_ids[: len(source)] = source
        labels = torch.full((self.target_len,), -100)
        labels[: len(target)] = target
        return {"input_ids": input_ids, "attention_mask": input_ids != PAD_ID, "labels": labels}


class T5TaskDataModule(pl.LightningDataModule):
    """Batches ``{"input_ids": (B, S), "attention_mask": (B, S), "labels": (B, T)}`` of generated tasks."""

    def __init__(self, batch_size: int, tasks: Sequence[str] = ("copy", "reverse", "sort", "add"),
                 max_len: int = 12, num_train_samples: int = 100_000, num_val_samples: int = 1_000,
                 num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.train_set = TaskDataset(tasks, max_len, num_train_samples, seed=0)
        self.val_set = TaskDataset(tasks, max_len, num_val_samples, seed=1)

    @property
    def tokens_per_sample(self) -> int:
        return self.train_set.input_len + self.train_set.target_len

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True, num_workers=self.num_workers)
