"""Models built on the meta device: planned from shapes, sharded, then materialized unit by unit.

The 2-rank runs train a 3-block GPT built under ``trainer.init_module(empty_init=True)`` (the way
Lightning documents for large models) next to the same GPT built eagerly under Lightning's DDP.
"""

from __future__ import annotations

import gc
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_launch import SCRIPTS, run_ranks  # noqa: E402
from meta_train import CONFIG, HAND_MADE, build  # noqa: E402
from osdp_lightning.recipes.gpt import GPT, GPTLitModule  # noqa: E402

from osdp_lightning.choices import ChoiceOptions  # noqa: E402
from osdp_lightning.choices import split as split_choice  # noqa: E402
from osdp_lightning.cost.budget import parse_memory_budget  # noqa: E402
from osdp_lightning.integration.config import OSDPConfig  # noqa: E402
from osdp_lightning.integration.setup_core import OSDPSetup, Ranks, StepInputs  # noqa: E402
from osdp_lightning.plan.measure import profile_lightning_module  # noqa: E402
from osdp_lightning.plan.pipeline import (  # noqa: E402
    WHOLE_PROFILE_STEP_COPIES,
    WHOLE_PROFILE_WEIGHT_COPIES,
    ProfileOptions,
    budget_floor_bytes,
    check_setup_fits,
    whole_profile_fits,
    whole_profile_peak_bytes,
)
from osdp_lightning.plan.unitbench import UnitMeasureError, profile_from_shapes  # noqa: E402
from osdp_lightning.profiling.fakestep import (  # noqa: E402
    FakeStepError,
    build_meta_module,
    peak_new_bytes,
    step_peak_bytes,
)
from osdp_lightning.profiling.materialize import UninitializedModuleError, has_meta_tensors, materialize  # noqa: E402
from osdp_lightning.profiling.profile import logging_disabled  # noqa: E402

STEPS = 6
BUDGET = "65%ddp"  # below every uniform layout but zero3's, with room for the 96 KiB a tiny model keeps: the plan mixes choices


def _run(tmp_path: Path, name: str, *args: str, steps: int = STEPS) -> list[dict]:
    out = tmp_path / name
    finished = run_ranks([str(SCRIPTS / "meta_train.py"), "--out", str(out), "--steps", str(steps), *args],
                         tmp_path / f"{name}.log", timeout_s=240)
    assert finished.returncode == 0, finished.log[-3000:]
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def seed_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("seed") / "seed.pt"
    torch.manual_seed(1)
    torch.save(build("gpt").state_dict(), path)
    return path


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory: pytest.TempPathFactory, seed_weights: Path) -> list[float]:
    """Lightning's DDP on the eagerly built GPT from the seed weights: the reference."""
    return _run(tmp_path_factory.mktemp("ddp"), "ddp.json", "--strategy", "ddp",
                "--seed-weights", str(seed_weights))[0]["losses"]


def test_meta_built_gpt_trains_like_ddp_under_a_mixed_plan(tmp_path: Path, seed_weights: Path,
                                                           ddp_losses: list[float]) -> None:
    """Every kind of choice (replicate, zero2 with checkpointing, zero3, a split Linear, a block
    descended into its parts), applied to the meta-built model: the same losses as DDP."""
    osdp = _run(tmp_path, "osdp.json", "--strategy", "osdp", "--meta", "--hand-made-plan",
                "--seed-weights", str(seed_weights))
    assert osdp[0]["plan"] == HAND_MADE
    assert osdp[0]["losses"] == pytest.approx(ddp_losses, rel=1e-4, abs=1e-6)
    assert len(osdp[0]["losses"]) == STEPS


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    """In bf16-true, without seed weights: 11 steps with a checkpoint after the first epoch (8 steps
    of 2 x 4 samples), then a fresh meta-built model resumed from it to step 11."""
    tmp_path = tmp_path_factory.mktemp("bf16")
    common = ("--strategy", "osdp", "--meta", "--budget", BUDGET, "--precision", "bf16-true")
    whole = _run(tmp_path, "whole.json", *common, "--save-every", "8", "--ckpt-dir", str(tmp_path), steps=11)
    resumed = _run(tmp_path, "resumed.json", *common, "--resume", str(tmp_path / "step=8.ckpt"), steps=11)
    return whole, resumed


def test_meta_built_gpt_is_initialised_alike_on_every_rank(bf16_runs: tuple[list[dict], list[dict]]) -> None:
    """As setup leaves it: the recipe's own init, replicated tensors identical on both ranks, every
    tensor finite and on the device; the loss starts where a random GPT's does."""
    ranks = bf16_runs[0]
    first, second = ranks[0]["state"], ranks[1]["state"]
    assert any(v["sharded"] for v in first.values()) and any(not v["sharded"] for v in first.values())
    for name, mine in first.items():
        assert mine["finite"] and not mine["meta"], name
        if not mine["sharded"]:
            assert mine["sum"] == second[name]["sum"], f"{name} differs between the ranks"
    # GPT-2's init: normal(0, 0.02) embeddings, residual projections scaled by 1/sqrt(2 * n_layer)
    assert first["net.wpe.weight"]["std"] == pytest.approx(0.02, rel=0.15)
    projection = next(v for k, v in first.items() if k.endswith("mlp.c_proj.weight"))
    assert projection["std"] == pytest.approx(0.02 / math.sqrt(2 * CONFIG.n_layer), rel=0.15)
    assert ranks[0]["losses"][0] == pytest.approx(math.log(CONFIG.vocab_size), rel=0.02)


def test_a_meta_built_gpt_resumes_from_its_checkpoint_exactly(bf16_runs: tuple[list[dict], list[dict]]) -> None:
    """The steps after the checkpoint equal the uninterrupted run's."""
    whole, resumed = bf16_runs
    assert len(whole[0]["losses"]) == 11
    assert resumed[0]["losses"] == pytest.approx(whole[0]["losses"][8:], rel=1e-5)


def test_a_module_no_reset_parameters_reaches_is_named_on_every_rank(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "bad.json", "--strategy", "osdp", "--meta", "--model", "uninit")
    for rank in ranks:
        assert "UninitializedModuleError" in rank["error"] or "not initialised" in rank["error"], rank
        assert "UninitializedGPT" in rank["error"] and "scale" in rank["error"]


def test_a_budget_setup_cannot_meet_is_an_error_on_every_rank(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "small.json", "--strategy", "osdp", "--meta", "--budget", "64KiB")
    for rank in ranks:
        assert "cannot hold even osdp's setup" in rank["error"] and "memory_budget='" in rank["error"], rank


# -- one process ------------------------------------------------------------------------------
def _gpt_batch(size: int = 4) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (size, CONFIG.block_size), generator=torch.Generator().manual_seed(0))
    return {"input_ids": tokens, "labels": tokens}


def test_fake_steps_leave_nothing_for_the_garbage_collector() -> None:
    """Setup measures the process's growth over profiling: what only cycles hold must be gone by then."""
    with torch.device("meta"):
        model = GPTLitModule(GPT(CONFIG))
    gc.collect()
    gc.disable()  # NOTE: only the functions' own collections may free it (without them: 36079 and 9453 objects)
    try:
        profile_from_shapes(model, _gpt_batch(), torch.device("cpu"))
        after_profile = gc.collect()
        step_peak_bytes(model, _gpt_batch())
        after_step = gc.collect()
    finally:
        gc.enable()
    assert after_profile < 1000 and after_step < 1000


def test_profile_from_shapes_matches_the_whole_profile_in_units_and_bytes() -> None:
    """Times are measured (how close they come is a benchmark's figure, docs/benchmarks.md)."""
    with torch.device("meta"):
        meta = GPTLitModule(GPT(CONFIG))
    shapes = profile_from_shapes(meta, _gpt_batch(), torch.device("cpu"), choices=ChoiceOptions(split_factors=(2,)))
    whole = profile_lightning_module(GPTLitModule(GPT(CONFIG)), _gpt_batch())
    assert has_meta_tensors(meta)  # nothing of the model itself was materialized
    assert [u.name for u in shapes.units] == [u.name for u in whole.units]
    for s, w in zip(shapes.units, whole.units, strict=True):
        assert (s.param_count, s.frozen_param_count) == (w.param_count, w.frozen_param_count)
    blocks = [u for u in shapes.units if u.name.startswith("net.h.")]
    assert len({(u.forward_s, u.backward_s) for u in blocks}) == 1  # one kind of block, measured once
    assert all(u.forward_s > 0 and u.backward_s > 0 for u in blocks)
    assert any(dict(p.split_overhead_s) for u in blocks for p in u.parts)  # measured on the real copy
    assert shapes.activation_bytes == pytest.approx(whole.activation_bytes, rel=0.1)
    assert shapes.step_s == pytest.approx(sum(u.forward_s + u.backward_s for u in shapes.units))


def test_kinds_of_unit_measured_apart_time_each_linear_shape_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two kinds of block (their activations differ) with Linears of one shape fed one input shape:
    the profile from shapes times splitting that Linear once, as the whole profile does."""
    class Block(nn.Module):
        def __init__(self, act: nn.Module) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(64, 64), act, nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(self.act(self.fc1(x)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(nn.ReLU()), Block(nn.Tanh())])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    timed: list[tuple[tuple[int, ...], int]] = []
    real = split_choice.measure_split_overhead_s

    def counting(linear: nn.Linear, x: torch.Tensor, k: int, *args: object, **kwargs: object) -> float:
        timed.append((tuple(x.shape), k))
        return real(linear, x, k, *args, **kwargs)
    monkeypatch.setattr(split_choice, "measure_split_overhead_s", counting)
    with torch.device("meta"):
        model = Model()
    profile = profile_from_shapes(model, torch.randn(8, 64), torch.device("cpu"), min_unit_params=1000,
                                  choices=ChoiceOptions(split_factors=(2, 4)), repeats=1)
    assert sorted(timed) == [((8, 64), 2), ((8, 64), 4)]
    parts = [p for u in profile.units for p in u.parts]
    assert len(parts) == 4 and len({p.split_overhead_s for p in parts}) == 1 and dict(parts[0].split_overhead_s).keys() == {2, 4}


def test_a_unit_that_cannot_run_alone_is_a_clear_error() -> None:
    class NeedsItsParent(nn.Module):
        """Reads what its parent set on it during the parent's forward."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.offset_from_parent

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(NeedsItsParent() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                block.offset_from_parent = x.mean(dim=0)
                x = block(x)
            return x

    with torch.device("meta"):
        model = Model()
    with pytest.raises(UnitMeasureError, match="cannot measure unit 'blocks.0'.*Build the model eagerly"):
        profile_from_shapes(model, torch.randn(2, 64), torch.device("cpu"))


def test_materialize_initialises_each_unit_from_reset_parameters_alone() -> None:
    """One process: the plan's units come alive one at a time, with GPT's init, ties kept."""
    with torch.device("meta"):
        model = GPTLitModule(GPT(CONFIG))
    template = build_meta_module(model)
    units = [("net.wte", "net.lm_head"), ("net.h.0",), ("net.h.1",), ("net.h.2",), ("",)]
    materialize(model, model, template, units, torch.device("cpu"), seed=3)
    assert not has_meta_tensors(model) and has_meta_tensors(template)
    assert model.net.lm_head.weight is model.net.wte.weight
    assert model.net.ln_f.weight.eq(1).all() and model.net.h[0].attn.c_attn.bias.eq(0).all()
    assert float(model.net.wte.weight.detach().std()) == pytest.approx(0.02, rel=0.1)
    with torch.device("meta"):
        again = GPTLitModule(GPT(CONFIG))
    materialize(again, again, build_meta_module(again), units, torch.device("cpu"), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))


def test_materialize_names_the_module_left_uninitialised() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.gain = nn.Parameter(torch.ones(8))

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(UninitializedModuleError, match=r"Scaled \(Scaled: gain\).*reset_parameters"):
        materialize(model, model, build_meta_module(model), [("lin",), ("",)], torch.device("cpu"), seed=0)


def test_an_eager_model_is_profiled_whole_only_where_three_copies_of_its_weights_fit() -> None:
    model = GPTLitModule(GPT(CONFIG))
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert whole_profile_fits(model, 3 * weights) and not whole_profile_fits(model, 3 * weights - 1)
    # "100%ddp" is at least the DDP state (weights, gradients, Adam's two moments): 4x the weights
    floor = budget_floor_bytes(model, parse_memory_budget("100%ddp"), device_bytes=2**40, world_size=2)
    assert floor == 4 * weights and whole_profile_fits(model, floor)
    assert not whole_profile_fits(model, budget_floor_bytes(model, parse_memory_budget("60%ddp"), 2**40, 2))


def test_a_fake_step_counts_the_bytes_a_real_step_creates() -> None:
    torch.manual_seed(0)
    model, batch = GPTLitModule(GPT(CONFIG)), _gpt_batch()
    fake = step_peak_bytes(model, batch)
    assert all(p.grad is None for p in model.parameters())  # the fake step ran on a fake copy
    with logging_disabled(model):
        real = peak_new_bytes(lambda: model.training_step(batch, 0).backward(), [*model.parameters(), *model.buffers()])
    assert fake == pytest.approx(real, rel=0.02)
    weights = sum(p.numel() * 4 for p in model.parameters())
    model.zero_grad(set_to_none=True)
    assert whole_profile_peak_bytes(model, batch) == 2 * weights + WHOLE_PROFILE_STEP_COPIES * fake


def _whole_under(budget: int | str, model: nn.Module, batch: object, **config: object) -> bool:
    setup = OSDPSetup(OSDPConfig(memory_budget=budget, **config), Ranks(torch.device("cpu"), 1, 1, 1, 0))
    return setup.decide_whole_profile(model, StepInputs(batch=lambda: batch, optimizer=None))


def test_under_a_real_limit_an_eager_model_is_profiled_whole_only_where_its_step_fits_too() -> None:
    model, batch = GPTLitModule(GPT(CONFIG)), _gpt_batch(size=16)
    weights = sum(p.numel() * 4 for p in model.parameters())
    peak = whole_profile_peak_bytes(model, batch)
    assert peak > WHOLE_PROFILE_WEIGHT_COPIES * weights  # this batch's activations outweigh a copy of the weights
    assert _whole_under(peak, model, batch) and not _whole_under(peak - 1, model, batch)
    # a budget that bounds the priced tensors, not the process, keeps the copies' rule
    assert _whole_under(WHOLE_PROFILE_WEIGHT_COPIES * weights, model, batch, budget_covers="tensors")
    with torch.device("meta"):
        meta = GPTLitModule(GPT(CONFIG))
    assert not _whole_under(10 * peak, meta, batch)


class _ReadsItsLoss(GPTLitModule):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 2 if loss.item() > 100 else loss  # a value no fake step has


def test_an_eager_model_no_fake_step_can_run_is_profiled_whole_under_a_real_limit() -> None:
    model, batch = _ReadsItsLoss(GPT(CONFIG)), _gpt_batch(size=16)
    weights = sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(FakeStepError, match="fake tensors"):
        whole_profile_peak_bytes(model, batch)
    assert _whole_under(WHOLE_PROFILE_WEIGHT_COPIES * weights, model, batch)
    assert not _whole_under(WHOLE_PROFILE_WEIGHT_COPIES * weights - 1, model, batch)


def test_a_budget_below_what_setup_itself_needs_is_refused_naming_one_that_works() -> None:
    with torch.device("meta"):
        model = GPTLitModule(GPT(CONFIG))
    block = sum(p.numel() * 4 for p in model.net.h[0].parameters())
    with pytest.raises(ValueError, match=r"cannot hold even osdp's setup.*'net.h.0'.*memory_budget='(\d+)B'") as err:
        check_setup_fits(model, ProfileOptions(), 2 * block)
    assert str(3 * block) in str(err.value)
    check_setup_fits(model, ProfileOptions(), 3 * block)
