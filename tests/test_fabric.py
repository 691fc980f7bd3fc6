"""``Fabric(strategy="osdp")``: a Fabric loop under a solved plan trains as Fabric's own DDP does.

The 2-rank runs (tests/scripts/fabric_train.py) train meta_train.py's GPT with AdamW for 8 steps:
Fabric's ``strategy="ddp"``; osdp at ``70%ddp`` (DDP does not fit), clipping the gradient norm,
saving at step 4; a hand-made plan with every kind of choice, accumulating 2 micro-batches under
``no_backward_sync``; a model built under ``fabric.init_module(empty_init=True)``, its optimizer
built after ``setup_module``, that resumes from step 4; and the Trainer strategy's checkpoint of the recipe's LightningModule, continued under
Fabric. The calibration cache is warm (made-up step terms): these runs check what training
computes, not what the plan predicts.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.utilities.distributed import _suggested_max_num_threads
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_launch import SCRIPTS, run_ranks  # noqa: E402
from meta_train import CONFIG  # noqa: E402
from osdp_lightning.recipes.gpt import GPT, GPTLitModule  # noqa: E402

from osdp_lightning import OSDPConfig, OSDPFabricStrategy, OSDPStrategy  # noqa: E402
from osdp_lightning.calibrate import CACHE_DRAWS, CACHE_ENV, cache_file, calibration_key, write_cache  # noqa: E402
from osdp_lightning.cost.step_terms import COLLECTIVES, GROUP_TERMS, PLAIN, Affine, StepTerms  # noqa: E402
from osdp_lightning.integration.fabric_checkpoint import save  # noqa: E402
from osdp_lightning.integration.fabric_inputs import (  # noqa: E402
    as_lightning_step,
    example_batch_of,
    parameter_names,
    rebind_optimizer,
)
from osdp_lightning.plan.measure import profile_lightning_module  # noqa: E402
from osdp_lightning.profiling.estimate import estimate_profile  # noqa: E402
from osdp_lightning.profiling.optim_state import configured_optimizer  # noqa: E402
from osdp_lightning.runtime.split import SplitLinear  # noqa: E402
from osdp_lightning.state.checkpoint import check_checkpoint, load_model_weights  # noqa: E402

STEPS = 8
CLIP = ("--clip", "0.5")  # below the gradient norm of every step: clipping acts


# -- one process ------------------------------------------------------------------------------
def test_import_registers_osdp_with_fabric_and_the_trainer_once() -> None:
    assert STRATEGY_REGISTRY["osdp"]["strategy"] is OSDPFabricStrategy
    assert StrategyRegistry["osdp"]["strategy"] is OSDPStrategy
    OSDPFabricStrategy.register_strategies(STRATEGY_REGISTRY)  # a second import: no error, no change
    assert STRATEGY_REGISTRY["osdp"]["strategy"] is OSDPFabricStrategy


def test_fabric_builds_the_osdp_strategy_from_its_name() -> None:
    fabric = L.Fabric(strategy="osdp", accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, OSDPFabricStrategy)
    assert fabric.strategy.config == OSDPConfig() and fabric.strategy.example_batch is None


def test_options_are_checked_when_the_strategy_is_built() -> None:
    strategy = OSDPFabricStrategy(OSDPConfig(memory_budget="6GiB"), split_factors=(), loss_fn=len)
    assert strategy.config.memory_budget == "6GiB" and strategy.config.split_factors == ()
    with pytest.raises(TypeError, match="unknown osdp option"):
        OSDPFabricStrategy(memory_budgt="6GiB")
    with pytest.raises(ValueError, match="Accepted forms"):
        OSDPFabricStrategy(memory_budget="70")
    with pytest.raises(ValueError, match="your loop sets the batch size"):
        OSDPFabricStrategy(micro_batch_size="auto")
    with pytest.raises(MisconfigurationException, match="Accumulation factor"):
        OSDPFabricStrategy(accumulate_grad_batches=0)


def test_what_exists_only_after_setup_says_so() -> None:
    strategy = OSDPFabricStrategy()
    for name in ("plan", "module"):
        with pytest.raises(RuntimeError, match=r"fabric\.setup"):
            getattr(strategy, name)
    with pytest.raises(RuntimeError, match="measured at setup"):
        strategy.cluster_spec()
    assert strategy.profile is None and strategy.setup_s == {} and not strategy.profiling


def test_a_missing_example_batch_names_the_ways_to_give_one() -> None:
    with pytest.raises(ValueError, match="example_batch=batch.*example_input_array"):
        example_batch_of(nn.Linear(4, 4), None)
    module = nn.Linear(4, 4)
    module.example_input_array = torch.zeros(2, 4)
    assert example_batch_of(module, None) is module.example_input_array
    assert example_batch_of(module, "mine") == "mine"


class _Forward(nn.Module):
    """A plain module with Lightning's ``example_input_array``, no ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(32, 32) for _ in range(3)))
        self.example_input_array = torch.randn(4, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_profiling_a_plain_module_runs_its_loss_or_its_summed_outputs() -> None:
    """The step profiling runs, its optimizer, in the copies profiling makes; gone afterwards."""
    module = _Forward()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    calls: list[nn.Module] = []

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        calls.append(model)
        return model(batch).square().mean()

    with as_lightning_step(module, optimizer, loss_fn, batch_is_example=True):
        assert configured_optimizer(module) is optimizer
        copied = copy.deepcopy(module)
        copied.training_step(module.example_input_array, 0)
        assert calls[-1] is copied  # the copy's step runs the copy
        profile = profile_lightning_module(module, module.example_input_array)
        assert calls[-1] is module and profile.micro_batch_size == 4
        # the fake step's copy prices the bound optimizer: one fp32 state (without one: Adam's two)
        assert estimate_profile(module, module.example_input_array, peak_flops_per_s=1e12).optimizer_bytes_per_param == 4
    assert not hasattr(module, "training_step") and not hasattr(module, "configure_optimizers")
    with as_lightning_step(module, None, None, batch_is_example=False), torch.no_grad():
        loss = module.training_step(module.example_input_array, 0)  # no loss_fn: the summed outputs
        assert float(loss) == pytest.approx(float(module(module.example_input_array).sum()))


def test_an_optimizer_built_before_setup_is_pointed_at_the_new_parameters() -> None:
    """By name; a split Linear's weight becomes its slices; a stepped optimizer is refused."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = parameter_names(model)
    model[1] = SplitLinear.from_linear(model[1], 2)
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    rebind_optimizer(optimizer, names, model)
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [
        id(model[0].weight), id(model[0].bias), id(model[1].slices[0].weight), id(model[1].slices[1].weight),
        id(model[1].bias)]
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="before its first step"):
        rebind_optimizer(optimizer, names, model)


def test_fabric_save_refuses_states_it_cannot_write() -> None:
    with pytest.raises(ValueError, match="the one model it set up"):
        save("unused", {"model": nn.Linear(2, 2)}, None, sharded=True, plan=None)


# -- 2 ranks ----------------------------------------------------------------------------------
def _warm_cache(cache_dir: Path) -> None:
    """:data:`CACHE_DRAWS` made-up calibrations for the key the ranks look up (AdamW, as Lightning's
    launcher sets their threads): setup reads them instead of measuring (seconds per launch)."""
    threads = int(os.environ.get("OMP_NUM_THREADS") or _suggested_max_num_threads(2))
    optimizer = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    key = {**calibration_key(torch.device("cpu"), 2, 2, optimizer, split=True), "backend": "gloo", "threads": threads}
    draw = StepTerms(collectives={kind: Affine(1e-4, 2e-9) for kind in COLLECTIVES},
                     overhead={kind: Affine(3e-3, 1e-9) for kind in GROUP_TERMS},
                     optimizer={kind: Affine(2e-5, 1e-9) for kind in (*GROUP_TERMS, PLAIN)}, loop_step_s=4e-3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(cache_dir))
        write_cache(cache_file(key), key, [draw] * CACHE_DRAWS)


@pytest.fixture(scope="module")
def fabric_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fabric")


@pytest.fixture(scope="module")
def runs(fabric_dir: Path) -> dict[str, list[dict]]:
    """Every 2-rank run of this module, by name (each rank's JSON)."""
    tmp = fabric_dir
    _warm_cache(tmp / "cache")
    env = {CACHE_ENV: str(tmp / "cache")}

    def run(name: str, script: str, *args: str) -> list[dict]:
        out = tmp / f"{name}.json"
        done = run_ranks([str(SCRIPTS / script), "--out", str(out), *args], tmp / f"{name}.log", timeout_s=240,
                         env=env)
        assert done.returncode == 0, done.log[-6000:]
        ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
        assert all("error" not in rank for rank in ranks), ranks
        return ranks

    return {
        "ddp": run("ddp", "fabric_train.py", "--strategy", "ddp", *CLIP),
        "osdp": run("osdp", "fabric_train.py", *CLIP, "--save-at", "4", "--ckpt-dir", str(tmp / "osdp"),
                    "--load-raw", str(tmp / "raw.pt")),
        "accumulated": run("accumulated", "fabric_train.py", "--hand-made-plan", *CLIP, "--accumulate", "2"),
        "meta_resumed": run("meta_resumed", "fabric_train.py", *CLIP, "--meta", "--optimizer-after-setup",
                            "--resume", str(tmp / "osdp" / "step=4")),
        "trainer": run("trainer", "meta_train.py", "--strategy", "osdp", "--budget", "60%ddp", "--steps", str(STEPS),
                       "--save-every", "4", "--ckpt-dir", str(tmp / "trainer")),
        "from_trainer": run("from_trainer", "fabric_train.py", "--lit", "--resume", str(tmp / "trainer" / "step=4.ckpt"),
                            "--save-at", str(STEPS), "--ckpt-dir", str(tmp / "from_trainer"), "--consolidated"),
    }


def _assert_same_losses(got: list[dict], reference: list[dict], steps: slice = slice(None)) -> None:
    for mine, theirs in zip(got, reference, strict=True):
        assert mine["losses"] == pytest.approx(theirs["losses"][steps], rel=1e-5)


@pytest.mark.multiprocess
def test_a_solved_mixed_plan_where_ddp_does_not_fit_trains_as_fabric_ddp(runs: dict[str, list[dict]]) -> None:
    """Losses and clipped gradient norms of every step equal Fabric's DDP."""
    osdp = runs["osdp"]
    assert osdp[0]["fits"]["replicate"] is False  # at 70%ddp the DDP layout does not fit
    assert len({choice.split("+")[0] == "replicate" for choice in osdp[0]["plan"].values()}) == 2, osdp[0]["plan"]
    assert len(osdp[0]["losses"]) == STEPS
    _assert_same_losses(osdp, runs["ddp"])
    for mine, theirs in zip(osdp, runs["ddp"], strict=True):
        assert min(theirs["norms"]) > 0.5  # every step clipped
        assert mine["norms"] == pytest.approx(theirs["norms"], rel=1e-5)
    assert osdp[0]["load_raw_sums"] == pytest.approx(osdp[0]["sums"], rel=1e-12)  # fabric.load_raw: all back


@pytest.mark.multiprocess
def test_no_backward_sync_accumulation_equals_the_whole_batch(runs: dict[str, list[dict]]) -> None:
    """Two micro-batches of 2 under a plan with every kind of choice (replicated units in DDP's
    reducer, zero2, zero3, a split Linear, checkpointing): what one batch of 4 gives under DDP."""
    accumulated = runs["accumulated"]
    assert {c.split("(")[0].split("+")[0] for c in accumulated[0]["plan"].values()} == {
        "replicate", "zero2", "zero3", "split"}
    _assert_same_losses(accumulated, runs["ddp"])
    for mine, theirs in zip(accumulated, runs["ddp"], strict=True):
        assert mine["norms"] == pytest.approx(theirs["norms"], rel=1e-5)


@pytest.mark.multiprocess
def test_a_meta_built_model_resumes_from_a_fabric_checkpoint_exactly(runs: dict[str, list[dict]]) -> None:
    """Built under ``fabric.init_module(empty_init=True)`` and set up before its optimizer
    (``setup_module``, then ``setup_optimizers``): planned from shapes, materialized (every tensor
    allocated and finite), then steps 5-8 from the step-4 checkpoint equal the uninterrupted run's."""
    resumed = runs["meta_resumed"]
    assert not resumed[0]["profiled_whole"] and all(rank["initial_ok"] for rank in resumed)
    _assert_same_losses(resumed, runs["osdp"], slice(4, None))


@pytest.mark.multiprocess
def test_a_trainer_checkpoint_continues_under_fabric_and_back(runs: dict[str, list[dict]], fabric_dir: Path) -> None:
    """The Trainer strategy's step-4 checkpoint (model, AdamW's groups and state, the schedule)
    continues under Fabric as the Trainer continued it; Fabric's checkpoint holds the
    LightningModule's keys (one consolidated file here), which the Trainer side reads."""
    _assert_same_losses(runs["from_trainer"], runs["trainer"], slice(4, None))
    path = fabric_dir / "from_trainer" / f"step={STEPS}"
    assert check_checkpoint(path) == "consolidated"
    weights = load_model_weights(path)
    GPTLitModule(GPT(CONFIG)).load_state_dict(weights)  # strict: every key of the LightningModule
    sums = runs["from_trainer"][0]["sums"]
    assert {k: float(v.double().sum()) for k, v in weights.items()} == pytest.approx(sums, rel=1e-6)
