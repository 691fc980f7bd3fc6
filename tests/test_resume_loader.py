"""What exact resume needs besides tensors: the data position and the RNG states (in-process, fast)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from osdp_lightning.state.resume import ResumableDataLoader, collect_rng_state, restore_rng_state

DATA = TensorDataset(torch.arange(20.0))


def make_loader() -> ResumableDataLoader:
    return ResumableDataLoader(DATA, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5))


def as_lists(batches: list) -> list[list[float]]:
    return [b[0].tolist() for b in batches]


def interrupted_state(epoch: int, batches: int) -> dict:
    """The loader's state after ``epoch`` full passes and ``batches`` batches of the next one."""
    loader = make_loader()
    for _ in range(epoch):
        list(loader)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return loader.state_dict()


@pytest.mark.parametrize("epoch, batches", [(0, 3), (1, 2), (1, 0)])
def test_a_fresh_loader_continues_where_the_saved_one_stopped(epoch: int, batches: int) -> None:
    straight = make_loader()
    passes = [as_lists(list(straight)) for _ in range(epoch + 2)]
    resumed = make_loader()
    resumed.load_state_dict(interrupted_state(epoch, batches))
    assert as_lists(list(resumed)) == passes[epoch][batches:]
    assert as_lists(list(resumed)) == passes[epoch + 1]  # and the pass after it is the same too


def test_a_state_saved_on_the_last_batch_resumes_at_the_next_pass() -> None:
    straight = make_loader()
    passes = [as_lists(list(straight)) for _ in range(2)]
    resumed = make_loader()
    resumed.load_state_dict(interrupted_state(0, len(passes[0])))
    assert as_lists(list(resumed)) == passes[1]


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    state = collect_rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random())
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
