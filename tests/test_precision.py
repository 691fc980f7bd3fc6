"""``precision="bf16-mixed"`` as hand-written FSDP2 runs it (torchtitan's policy: gather in bf16,
reduce in fp32), priced by the plan: the flags, the bytes per choice, units of mixed dtypes, the
dry run's profile, and 2 real gloo ranks against the same plan laid out by hand and Lightning's DDP."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from toy_models import MLP, Regression, TiedLM  # noqa: E402

from osdp_lightning.apply.apply import mixed_precision_policy  # noqa: E402
from osdp_lightning.choices import Choice, ChoiceOptions  # noqa: E402
from osdp_lightning.choices.base import check_one_dtype  # noqa: E402
from osdp_lightning.cost.cluster import ClusterSpec  # noqa: E402
from osdp_lightning.integration.config import OSDPConfig  # noqa: E402
from osdp_lightning.plan.choice_table import build_choice_table  # noqa: E402
from osdp_lightning.plan.measure import profile_lightning_module  # noqa: E402
from osdp_lightning.plan.plan import make_plan  # noqa: E402
from osdp_lightning.profiling.estimate import estimate_profile  # noqa: E402
from osdp_lightning.profiling.precision import check_plan_precision, sharded_precision, with_precision  # noqa: E402
from osdp_lightning.profiling.records import ModelProfile  # noqa: E402

CLUSTER = ClusterSpec(world_size=2, memory_budget_bytes=2**40, collective_latency_s=1e-4, bandwidth_bytes_per_s=1e9)
BF16 = sharded_precision("bf16-mixed")
WIDTH = 256


def autocast() -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def mlp_profile() -> ModelProfile:
    """The 4-block MLP measured under autocast, as the strategy measures it under bf16-mixed."""
    model = MLP(width=WIDTH)
    return profile_lightning_module(model, next(iter(model.train_dataloader())), step_context=autocast, repeats=1,
                                    optimizer=model.configure_optimizers(), choices=ChoiceOptions(activation_checkpointing="never"),
                                    gather_dtype=torch.bfloat16)


def test_precision_flags_map_to_fsdp2_policies_or_say_what_works() -> None:
    policy = mixed_precision_policy("bf16-mixed")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy("bf16-mixed", "bfloat16").reduce_dtype == torch.bfloat16
    for flag in ("32-true", "bf16-true", "16-true", "64-true", None):  # the parameters' own dtype
        assert sharded_precision(flag) == sharded_precision("32-true") and not sharded_precision(flag).param_dtype
    with pytest.raises(ValueError, match=r"16-mixed.*bf16-mixed.*'32-true'"):
        sharded_precision("16-mixed")
    with pytest.raises(ValueError, match="supported"):
        sharded_precision("fp8")
    with pytest.raises(ValueError, match="reduce_dtype"):
        OSDPConfig(reduce_dtype="float16")
    assert OSDPConfig(reduce_dtype="bfloat16").profile_options("bf16-mixed", split=False).reduce_dtype == "bfloat16"


def test_profile_records_autocast_copies_of_the_weights(mlp_profile: ModelProfile) -> None:
    # Linear weights after the first (whose input needs no gradient, so its weight is not saved)
    copies = {u.name: u.cast_param_bytes for u in mlp_profile.units}
    assert copies == {"net.0": 0, "net.2": 2 * WIDTH**2, "net.4": 2 * WIDTH**2, "net.6": 2 * WIDTH**2, "": 2 * WIDTH}
    assert all(u.param_dtypes == ("float32",) for u in mlp_profile.units)


def test_what_sharded_units_save_is_measured_as_fsdp2_runs_them_and_estimated_alike() -> None:
    """Gathered in bf16 with its inputs cast (FSDP2's policy), a transformer block saves no copy of its
    weights and keeps its residual stream and norms' inputs in bf16, where autocast kept them fp32."""
    batch = next(iter(TiedLM().train_dataloader()))
    model = TiedLM()
    measured = profile_lightning_module(model, batch, step_context=autocast, choices=ChoiceOptions(activation_checkpointing="never"), repeats=1,
                                        optimizer=model.configure_optimizers(), gather_dtype=torch.bfloat16)
    estimated = estimate_profile(TiedLM, batch, peak_flops_per_s=1e12, precision="bf16-mixed")
    fields = ("name", "activation_bytes", "cast_param_bytes", "sharded_activation_bytes")
    assert [[getattr(u, f) for f in fields] for u in measured.units] == [
        [getattr(u, f) for f in fields] for u in estimated.units]
    blocks = [u for u in measured.units if u.name.startswith("blocks.")]
    assert blocks and all(0 < u.sharded_activation_bytes < u.activation_bytes - u.cast_param_bytes for u in blocks)


def test_bf16_mixed_prices_bf16_gathers_and_fp32_reductions(mlp_profile: ModelProfile) -> None:
    fp32_table = build_choice_table(with_precision(mlp_profile, sharded_precision("32-true")), CLUSTER)
    assert fp32_table == build_choice_table(mlp_profile, CLUSTER)  # 32-true prices what it always did
    bf16 = with_precision(mlp_profile, BF16)
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.compute_bytes_per_element, bf16.reduce_bytes_per_element) == (
        "bfloat16", "float32", 2, 4)
    bf16_table = build_choice_table(bf16, CLUSTER)
    params = WIDTH * WIDTH + WIDTH
    fp32, half = fp32_table.units[1], bf16_table.units[1]  # net.2
    for name in ("zero2", "zero3"):
        a, b = fp32.cost_of(name), half.cost_of(name)
        assert a.state_bytes == b.state_bytes  # fp32 master shards, gradients and Adam state
        assert (a.prefetch_bytes, b.prefetch_bytes) == (4 * params, 2 * params)  # gathered parameters
        assert (a.reduce_bytes, b.reduce_bytes) == (4 * params, 4 * params)  # reduce-scattered in fp32
        assert b.comm_s < a.comm_s
        # the gathered bf16 weight is what the matmul saves: no autocast copy beside it
        assert (a.activation_bytes, b.activation_bytes) == (2 * WIDTH**2, 0)
    assert (fp32.cost_of("zero2").held_bytes, half.cost_of("zero2").held_bytes) == (4 * params, 2 * params)
    assert fp32.cost_of("replicate") == half.cost_of("replicate")  # fp32 under autocast: as before
    # reduced in bf16 when asked: half the reduce-scatter's bytes
    bf16_reduce = build_choice_table(with_precision(mlp_profile, sharded_precision("bf16-mixed", "bfloat16")), CLUSTER)
    assert bf16_reduce.units[1].cost_of("zero3").reduce_bytes == 2 * params


class HalfBiasMLP(Regression):
    """A Linear whose bias is bf16 beside its fp32 weight: FSDP2 cannot shard it as one group."""

    def __init__(self) -> None:
        super().__init__()
        self.width = 64
        self.mixed = nn.Linear(64, 64)
        self.mixed.bias.data = self.mixed.bias.data.to(torch.bfloat16)
        self.plain = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        with autocast():
            return self.head(torch.relu(self.plain(torch.relu(self.mixed(x))))).float()


def test_a_unit_of_mixed_dtypes_is_replicated_and_refused_by_name_when_sharded() -> None:
    model = HalfBiasMLP()
    profile = profile_lightning_module(model, next(iter(model.train_dataloader())), min_unit_params=1000,
                                       optimizer=model.configure_optimizers(), choices=ChoiceOptions(activation_checkpointing="never"))
    units = {u.name: u for u in profile.units}
    assert units["mixed"].param_dtypes == ("bfloat16", "float32") and units["mixed"].mixed_dtypes
    assert not units["plain"].mixed_dtypes
    choices = {u.name: u.choice for u in make_plan(profile, CLUSTER, uniform_choice="zero3").units}
    assert choices["mixed"] == "replicate" and choices["plain"] == "zero3"
    with pytest.raises(ValueError, match=r"unit 'mixed' cannot take zero3.*bfloat16 \(mixed.bias\).*float32"):
        check_one_dtype(model.mixed, set(), ("mixed",), Choice("zero3"))
    check_one_dtype(model.mixed, {model.mixed.bias}, ("mixed",), Choice("zero3"))  # replicated below it: fine


def test_a_saved_plan_applies_with_the_precision_it_was_priced_for(mlp_profile: ModelProfile) -> None:
    bf16_plan = make_plan(with_precision(mlp_profile, BF16), CLUSTER, uniform_choice="zero3")
    assert (bf16_plan.param_dtype, bf16_plan.reduce_dtype) == ("bfloat16", "float32")
    assert "sharded units gather bfloat16, reduce float32" in bf16_plan.format_table()
    assert check_plan_precision(bf16_plan, "bf16-mixed") is None
    with pytest.raises(ValueError, match="plan again"):
        check_plan_precision(bf16_plan, "32-true")
    old = dataclasses.replace(bf16_plan, param_dtype="", reduce_dtype="")  # saved before plans named one
    assert "as it was priced" in check_plan_precision(old, "bf16-mixed")


def test_gpu_dry_runs_price_bf16_gathers() -> None:
    from osdp_lightning.cli.common import cluster_spec
    from osdp_lightning.plan import dryrun

    for overrides, reduce_bytes in (([], 4), (["strategy.reduce_dtype=bfloat16"], 2)):
        cfg = dryrun.compose_config(["model=gpt_tiny", "cluster=a100_80g_x8", *overrides])
        profile, _ = dryrun.estimate_recipe_profile(cfg, cluster_spec(cfg.cluster))
        assert (profile.param_dtype, profile.compute_bytes_per_element) == ("bfloat16", 2)
        assert profile.reduce_bytes_per_element == reduce_bytes
        assert sum(u.cast_param_bytes for u in profile.units) > 0


DDP_BF16 = ("--model", "mlp", "--strategy", "ddp", "--precision", "bf16-mixed", "--steps", "8")
"""Lightning's DDP under bf16-mixed, 8 steps: the run test_core_multiprocess compares zero3 with too."""


@pytest.mark.multiprocess
def test_bf16_mixed_plan_trains_as_hand_written_fsdp2_and_ddp(train, tmp_path: Path) -> None:
    """A solved mix of replicated and sharded units under bf16-mixed: the losses of the same units laid
    out by hand (FSDP2 with torchtitan's policy, DDP) and of Lightning's DDP; every gathered element
    bf16 (half of fp32's bytes); the measured peak within 5% of the predicted."""
    ddp = train("ddp", *DDP_BF16)
    osdp = train("osdp", *DDP_BF16[:2], "--budget", "120%zero2", "--split-factors", "", "--activation-checkpointing",
                 "never", *DDP_BF16[4:])
    plan = osdp[0]["plan"]
    assert (plan["param_dtype"], plan["reduce_dtype"]) == ("bfloat16", "float32")
    choices = [u["choice"] for u in plan["units"]]
    assert "replicate" in choices and {"zero2", "zero3"} & set(choices), choices
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    hand = train("hand", *DDP_BF16[:2], "--strategy", "hand", "--plan", str(plan_file), *DDP_BF16[4:])
    for ours, by_hand, lightning in zip(osdp, hand, ddp, strict=True):
        assert len(ours["losses"]) == 8
        assert ours["losses"] == pytest.approx(by_hand["losses"], rel=1e-3)
        assert ours["losses"] == pytest.approx(lightning["losses"], rel=2e-2)
        # every all-gather moved bf16 (2 bytes an element, fp32's 4): at least each sharded unit's
        # parameters once a step (zero2; zero3 twice)
        sharded = sum(u["param_count"] * (1 + (u["choice"] == "zero3")) for u in plan["units"]
                      if u["name"] and u["choice"] != "replicate")
        for gathered, elements in zip(ours["gathered_bytes_per_batch"], ours["gathered_elements_per_batch"],
                                      strict=True):
            assert gathered == 2 * elements >= 2 * sharded
    summary = osdp[0]["summary"]
    error = summary["predicted_peak_bytes"] / summary["peak_bytes"] - 1
    assert abs(error) <= 0.05, f"measured {summary['peak_bytes']} vs predicted {summary['predicted_peak_bytes']}"
