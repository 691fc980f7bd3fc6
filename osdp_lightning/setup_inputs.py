"""What the strategy reads from the user and the Trainer before planning: its options, checked
when it is built; the micro-batch size where the module or its DataModule keeps it; the first
training batch, taken so that the loader starts its epoch as it would under DDP."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from osdp_lightning.budget import parse_bytes
from osdp_lightning.choices import ALIASES, known_names, resolve


def check_micro_batch_size(value: Any) -> int | str | None:
    if value is None or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"micro_batch_size must be a positive int, 'auto' or None; got {value!r}")


def check_uniform_choice(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return str(resolve(value))
    except ValueError:
        raise ValueError(f"uniform_choice {value!r} is not one of {known_names()} or the aliases "
                         f"{list(ALIASES)}") from None


def check_headroom(value: float | int | str | None) -> float | int | str | None:
    """A share of the budget (a float below 1), bytes (an int or ``"256MiB"``), or None (the default)."""
    if value is None or (isinstance(value, float) and 0 <= value < 1) or value in (0, "0"):
        return value
    parse_bytes(value)  # raises, naming the accepted forms
    return value


def check_split_factors(factors: Sequence[int]) -> tuple[int, ...]:
    factors = tuple(factors or ())
    bad = [k for k in factors if not isinstance(k, int) or k < 2]
    if bad:
        raise ValueError(f"split_factors must be integers >= 2 (or () to turn splitting off); got {bad}")
    return factors


def _batch_size_owner(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
    return lightning_hasattr(module, "batch_size")


def current_batch_size(trainer: pl.Trainer, module: pl.LightningModule, default: int) -> int:
    return int(lightning_getattr(module, "batch_size")) if _batch_size_owner(trainer, module) else default


def set_batch_size(trainer: pl.Trainer, module: pl.LightningModule, size: int) -> None:
    if not _batch_size_owner(trainer, module):
        raise ValueError("micro_batch_size needs a `batch_size` attribute on the LightningModule or its "
                         "DataModule (the way Lightning's batch-size finder sets it); none was found")
    lightning_setattr(module, "batch_size", size)


def first_training_batch(trainer: pl.Trainer, module: pl.LightningModule, strategy: Strategy) -> Any:
    """One real training batch, moved to the device the way Lightning will move it."""
    source = trainer.fit_loop._data_source
    if trainer.state.fn != TrainerFn.FITTING or not source.is_defined():
        return None  # profile with example_input_array
    loader = source.dataloader()
    # NOTE: a loader's own generators (its shuffle, its workers' base seed) are not the global ones
    # that preserved_rng restores; a loader the user hands out again must start its epoch as under DDP.
    generators = _loader_generators(loader)
    states = [g.get_state() for g in generators]
    try:
        batch = next(iter(loader))
    finally:
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)
    return strategy.batch_to_device(batch, strategy.root_device)


def _loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators a data loader (or a dict or sequence of them) and its samplers draw from."""
    if isinstance(loader, Mapping):
        return [g for item in loader.values() for g in _loader_generators(item)]
    if isinstance(loader, (list, tuple)):
        return [g for item in loader for g in _loader_generators(item)]
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = (loader, sampler, batch_sampler, getattr(batch_sampler, "sampler", None))
    found: list[torch.Generator] = []
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found

