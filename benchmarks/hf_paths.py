"""The two ways osdp profiles a Hugging Face model, in one process (part ``paths`` of
:mod:`benchmarks.hf_models`; :mod:`benchmarks.profile_paths` does the same for the GPT recipe).

Whole: the real training step of the eagerly built model, timed per unit. From shapes: the model
built on the meta device, a fake step for bytes, one real copy of each kind of unit for time, and
what no copy covers (the root: embeddings' lookups, final norm, the loss) priced by FLOPs. The two
ways alternate for ``rounds`` rounds; each figure is the median over rounds.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

import torch

from benchmarks.hf_worker import HFBenchModule, Shape, token_sequences
from osdp_lightning.choices import ChoiceOptions
from osdp_lightning.plan.pipeline import ProfileOptions, profile_model
from osdp_lightning.profiling.optim_state import configured_optimizer
from osdp_lightning.profiling.records import ModelProfile

WAYS = ("whole", "shapes")
_BLOCK = re.compile(r"\.\d+$")
"""A transformer block's unit name ends in its index (``net.model.layers.3``, ``net.encoder.block.0``)."""


def unit_group(name: str) -> str:
    """``root`` (the model's own parameters, the loss), ``blocks``, or ``other`` (embeddings, heads)."""
    if not name:
        return "root"
    return "blocks" if _BLOCK.search(name) else "other"


def group_seconds(profile: ModelProfile) -> dict[str, float]:
    """Forward + backward seconds of each unit group of ``profile``."""
    out = {"root": 0.0, "blocks": 0.0, "other": 0.0}
    for unit in profile.units:
        out[unit_group(unit.name)] += unit.forward_s + unit.backward_s
    return out


def profile_once(family: str, shape: Shape, way: str) -> tuple[float, ModelProfile]:
    """Seconds one profile of ``family`` takes ``way``, and the profile."""
    torch.manual_seed(0)
    if way == "whole":
        module = HFBenchModule(family, shape)
    else:
        with torch.device("meta"):
            module = HFBenchModule(family, shape)
    batch = (token_sequences(shape, shape.batch_size),)
    start = time.perf_counter()
    profile = profile_model(module, batch, torch.device("cpu"), ProfileOptions(choices=ChoiceOptions(split_factors=(2, 4, 8))),
                            whole=way == "whole", optimizer=configured_optimizer(module))
    return time.perf_counter() - start, profile


def compare_family(family: str, shape: Shape, rounds: int) -> dict[str, Any]:
    """Medians over ``rounds`` of each way's seconds, predicted step (the profile's forward +
    backward), per-group unit seconds and activation bytes."""
    runs: dict[str, list[tuple[float, ModelProfile]]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            runs[way].append(profile_once(family, shape, way))
    row: dict[str, Any] = {"family": family, "rounds": rounds}
    for way in WAYS:
        samples = runs[way]
        groups = [group_seconds(p) for _, p in samples]
        row[way] = {"seconds": statistics.median(s for s, _ in samples),
                    "step_s": statistics.median(p.step_s for _, p in samples),
                    "units_s": statistics.median(sum(g.values()) for g in groups),
                    **{f"{k}_s": statistics.median(g[k] for g in groups) for k in ("root", "blocks", "other")},
                    "activation_bytes": samples[-1][1].activation_bytes,
                    "param_count": samples[-1][1].param_count}
    return row


def compare_paths(families: list[str], shape: Shape, rounds: int, threads: int = 1) -> list[dict[str, Any]]:
    """:func:`compare_family` of each family, with ``threads`` intra-op threads (1: as each of 2
    ranks on 2 cores gets)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = []
        for family in families:
            rows.append({**compare_family(family, shape, rounds), "threads": threads})
            from benchmarks.hf_models_report import paths_progress

            print(paths_progress(rows[-1]), flush=True)
        return rows
    finally:
        torch.set_num_threads(before)
