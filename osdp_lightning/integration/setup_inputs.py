"""What the strategy reads from the Trainer before planning: the micro-batch size where the module
or its DataModule keeps it; the first training batch, taken so that the loader starts its epoch as
it would under DDP. (Its options are checked in :mod:`osdp_lightning.integration.config`.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr


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

