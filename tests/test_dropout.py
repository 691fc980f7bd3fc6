"""Dropout under a plan the strategy solves itself: setup leaves every random state as it found it,
so the first training step draws the masks it draws under Lightning's DDP."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.fabric.utilities.distributed import _suggested_max_num_threads
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from toy_models import DropoutMLP  # noqa: E402

from osdp_lightning import OSDPStrategy  # noqa: E402
from osdp_lightning.calibrate import (  # noqa: E402
    CACHE_DRAWS,
    CACHE_ENV,
    cache_file,
    calibration_key,
    write_cache,
)
from osdp_lightning.cost.step_terms import COLLECTIVES, GROUP_TERMS, PLAIN, Affine, StepTerms  # noqa: E402

STEPS = 8
DDP_ARGS = ("--model", "dropout_mlp", "--steps", str(STEPS), "--strategy", "ddp")
# dropout_mlp on 2 ranks, micro-batch 8: the smallest budget that fits is about 3.0 MiB, all-replicate
# needs about 4.4 MiB plus the headroom; at 4.1 MiB one block fits replicated beside sharded ones.
MIXED_BUDGET = "4.1MiB"


def _random_states() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _assert_same_states(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert torch.equal(before["torch"], after["torch"]), "torch's CPU generator moved"
    assert before["python"] == after["python"], "Python's random moved"
    assert all(np.array_equal(a, b) for a, b in zip(before["numpy"], after["numpy"], strict=True)), "NumPy moved"


class _KeptLoaderMLP(DropoutMLP):
    """Hands out one DataLoader with its own generator, as a DataModule that builds it once does."""

    def __init__(self) -> None:
        super().__init__(width=32, depth=2)
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
        self.loader = DataLoader(TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True)), batch_size=8, shuffle=True,
                                 generator=torch.Generator().manual_seed(7))

    def train_dataloader(self) -> DataLoader:
        return self.loader


class _StatesAroundStrategySetup(L.Callback):
    """Random states when the callbacks' ``setup`` runs (before the strategy's) and at ``on_fit_start`` (after)."""

    def __init__(self) -> None:
        self.states: dict[str, dict[str, Any]] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.states["before"] = {**_random_states(), "loader": pl_module.loader.generator.get_state()}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.states["after"] = {**_random_states(), "loader": pl_module.loader.generator.get_state()}


def test_setup_leaves_every_random_state_as_it_found_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the planning draws (a cold calibration reseeds torch), the step after setup sees the user's stream."""
    plan_and_apply = OSDPStrategy._plan_and_apply

    def drawing_plan_and_apply(self: OSDPStrategy, *args: Any) -> Any:
        torch.manual_seed(0)
        torch.rand(3), random.random(), np.random.rand(2)
        return plan_and_apply(self, *args)

    monkeypatch.setattr(OSDPStrategy, "_plan_and_apply", drawing_plan_and_apply)
    L.seed_everything(5)
    watch = _StatesAroundStrategySetup()
    trainer = L.Trainer(strategy=OSDPStrategy(), accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[watch])
    trainer.fit(_KeptLoaderMLP())
    assert trainer.strategy.plan.units  # it planned (and profiled a batch from the kept loader)
    _assert_same_states(watch.states["before"], watch.states["after"])
    assert torch.equal(watch.states["before"]["loader"], watch.states["after"]["loader"]), "the loader's shuffle moved"


def _osdp_args(checkpointing: str) -> tuple[str, ...]:
    return ("--model", "dropout_mlp", "--steps", str(STEPS), "--budget", MIXED_BUDGET,
            "--activation-checkpointing", checkpointing)


def _assert_losses_match_ddp(ddp: list[dict], osdp: list[dict]) -> None:
    sharded = {u["choice"].split("+")[0] != "replicate" for u in osdp[0]["plan"]["units"]}
    assert sharded == {True, False}, f"not a mixed plan: {[u['choice'] for u in osdp[0]['plan']['units']]}"
    for ref, got in zip(ddp, osdp, strict=True):
        assert len(ref["losses"]) == len(got["losses"]) == STEPS
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)


def _make_cache_warm(cache_dir: Path) -> None:
    """:data:`CACHE_DRAWS` calibrations of this machine's order for the key the ranks will look up
    (their thread count is the one Lightning's launcher sets), for the next launch to read."""
    optimizer = DropoutMLP(width=8).configure_optimizers()
    threads = int(os.environ.get("OMP_NUM_THREADS") or _suggested_max_num_threads(2))
    key = {**calibration_key(torch.device("cpu"), 2, 2, optimizer, split=True), "backend": "gloo", "threads": threads}
    draw = StepTerms(collectives={kind: Affine(1e-4, 2e-9) for kind in COLLECTIVES},
                     overhead={kind: Affine(3e-3, 1e-9) for kind in GROUP_TERMS},
                     optimizer={kind: Affine(2e-5, 1e-9) for kind in (*GROUP_TERMS, PLAIN)}, loop_step_s=4e-3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(cache_dir))
        write_cache(cache_file(key), key, [draw] * CACHE_DRAWS)


# NOTE: a cold cache calibrates at setup (and draws random numbers there), a warm one reads the cache
# and draws none; with checkpointing, recomputed blocks must draw their forward's masks again.
@pytest.mark.multiprocess
@pytest.mark.parametrize("checkpointing, cache", [("never", "cold"), ("always", "warm")])
def test_solved_mixed_plan_with_dropout_matches_ddp_with_a_cold_or_a_warm_calibration_cache(
        train, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpointing: str, cache: str) -> None:
    ddp = train("ddp", *DDP_ARGS)
    assert len(set(ddp[0]["losses"])) > 1  # it trained
    if cache == "warm":
        _make_cache_warm(tmp_path / "cache")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    osdp = train(f"{cache}_{checkpointing}", *_osdp_args(checkpointing))
    source = osdp[0]["plan"]["step_terms_source"]
    assert source.startswith("measured at setup" if cache == "cold" else "cache "), source
    _assert_losses_match_ddp(ddp, osdp)
    if checkpointing == "always":
        assert all(u["choice"].endswith("+ckpt") for u in osdp[0]["plan"]["units"] if u["name"])
