"""Budgets people can say: bytes, sizes, a share of the device, a share of a baseline's peak."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import CliHere
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from test_cli import plan_gpt_tiny

from osdp_lightning import OSDPStrategy
from osdp_lightning.cli.common import cluster_spec
from osdp_lightning.cost.budget import (
    MIN_BYTES_BUDGET,
    MemoryBudget,
    absolute_budget_bytes,
    default_memory_budget,
    device_memory_bytes,
    format_budget,
    parse_memory_budget,
)
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.measure import profile_lightning_module
from osdp_lightning.plan.plan import InfeasibleBudgetError, baseline_peak_bytes, make_plan

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from toy_models import MLP  # noqa: E402

GIB = 2**30


@pytest.mark.parametrize("value, expected", [
    (8 * GIB, MemoryBudget("8589934592", bytes=8 * GIB)),
    ("6GiB", MemoryBudget("6GiB", bytes=6 * GIB)),
    ("512MB", MemoryBudget("512MB", bytes=512 * 10**6)),
    (str(3 * 2**20), MemoryBudget(str(3 * 2**20), bytes=3 * 2**20)),
    ("70%", MemoryBudget("70%", share=0.7)),
    ("100 %", MemoryBudget("100 %", share=1.0)),
    ("95%ddp", MemoryBudget("95%ddp", share=0.95, baseline="replicate")),
    ("120%zero3", MemoryBudget("120%zero3", share=1.2, baseline="zero3")),
    ("80%zero2", MemoryBudget("80%zero2", share=0.8, baseline="zero2")),
])
def test_accepted_forms(value: object, expected: MemoryBudget) -> None:
    assert parse_memory_budget(value) == expected


@pytest.mark.parametrize("value, message", [
    ("70", "70 bytes, too small.*did you mean '70%'"),
    (70, "70 bytes, too small.*did you mean '70%'"),
    ("170%", "more than the whole device.*'120%zero3'"),
    ("-1GiB", "must be positive"),
    ("-5%", "must be positive"),
    ("0%", "must be positive"),
    ("95%fsdp2", "cannot read memory budget '95%fsdp2'"),
    ("lots", "cannot read memory budget 'lots'"),
    ("5%%", "cannot read"),
])
def test_bad_forms_are_clear_errors_naming_the_accepted_ones(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_memory_budget(value)
    if value != "170%":
        assert "'8GiB'" in str(info.value) and "'70%'" in str(info.value) and "'95%ddp'" in str(info.value)
    with pytest.raises(ValueError, match=message):
        OSDPStrategy(memory_budget=value)  # the strategy refuses it at construction


def test_a_share_of_the_device_is_what_the_default_takes_a_share_of() -> None:
    cpu = torch.device("cpu")
    whole = device_memory_bytes(cpu, 2)
    assert parse_memory_budget("80%").of_device(whole) == pytest.approx(default_memory_budget(cpu, 2), abs=1)
    strategy = OSDPStrategy(memory_budget="50%")
    assert strategy.memory_budget_bytes is None  # known only on the device
    assert absolute_budget_bytes("50%") is None and absolute_budget_bytes("1GiB") == GIB


def test_a_share_of_a_baseline_peak_is_that_share_of_its_predicted_peak() -> None:
    model = MLP(width=64)
    batch = (torch.randn(8, 64), torch.randn(8, 1))
    profile = profile_lightning_module(model, batch, optimizer=torch.optim.Adam(model.parameters()), repeats=1)
    cluster = ClusterSpec(world_size=2, memory_budget_bytes=GIB, collective_latency_s=1e-4, bandwidth_bytes_per_s=1e9)
    ddp_peak = baseline_peak_bytes(profile, cluster, "replicate")
    assert ddp_peak == {b.choice: b.peak_bytes for b in make_plan(profile, cluster).baselines}["replicate"]
    budget = parse_memory_budget("90%ddp").of_peak(ddp_peak)
    assert budget == int(0.9 * ddp_peak)
    plan = make_plan(profile, ClusterSpec(world_size=2, memory_budget_bytes=budget, collective_latency_s=1e-4,
                                          bandwidth_bytes_per_s=1e9))
    assert plan.predicted_peak_bytes <= budget and not {b.choice: b.fits for b in plan.baselines}["replicate"]


def test_budget_forms_in_conf_reach_the_strategy_and_the_planner() -> None:
    with initialize_config_module(config_module="osdp_lightning.conf", version_base="1.3"):
        main = compose(config_name="train")
        share = compose(config_name="train", overrides=["cluster=a100_80g_x8", "cluster.memory_budget=50%"])
    assert main.cluster.memory_budget == "100%ddp"  # the main job: a budget ddp does not fit
    strategy = instantiate(main.strategy, _convert_="all")
    assert strategy.memory_budget == MemoryBudget("100%ddp", share=1.0, baseline="replicate")
    assert cluster_spec(share.cluster).memory_budget_bytes == 40 * GIB  # half of memory_per_device


def test_osdp_plan_resolves_a_share_of_the_ddp_peak_after_profiling(tmp_path: Path, cli_here: CliHere) -> None:
    proc, run_dir = plan_gpt_tiny(cli_here, tmp_path, "cluster.memory_budget=100%ddp", "strategy.split_factors=[]")
    assert "budget 100%ddp per rank" in proc.stdout and "memory budget 100%ddp = " in proc.stdout
    rows = {r["strategy"]: r for r in json.loads((run_dir / "comparison.json").read_text())["rows"]}
    assert rows["ddp"]["memory_budget_bytes"] == rows["ddp"]["predicted_peak_bytes"]  # 100% of ddp's peak
    assert not rows["ddp"]["fits"] and rows["osdp"]["fits"] and (run_dir / "plan.png").exists()


@pytest.mark.parametrize("value, nbytes", [
    ("900KiB", 900 * 2**10), ("883732B", 883732), ("0.5MiB", 2**19), ("64KB", 64_000), ("1B", 1),
])
def test_a_size_with_a_unit_is_taken_at_its_word_however_small(value: str, nbytes: int) -> None:
    assert parse_memory_budget(value) == MemoryBudget(value, bytes=nbytes)
    assert OSDPStrategy(memory_budget=value).memory_budget_bytes == nbytes


@pytest.mark.parametrize("value", [972106, "972106", 1e3, "512"])
def test_a_bare_number_below_a_mib_is_refused_naming_the_bytes_form_that_is_accepted(value: object) -> None:
    with pytest.raises(ValueError, match="too small to hold a model") as info:
        parse_memory_budget(value)
    said = re.search(r"bytes say '([^']+)'", str(info.value)).group(1)
    assert parse_memory_budget(said).bytes == int(float(value))
    assert "%'" not in str(info.value).split("Accepted forms")[0]  # no '972106%': more than the device


@pytest.mark.parametrize("nbytes", [1, 1000, 883732, 2**10, 1025 * 2**10, 3 * 2**20, MIN_BYTES_BUDGET - 1,
                                    8 * GIB, 8 * GIB + 1, 2**40 + 2**30])
def test_format_budget_is_exact_and_accepted(nbytes: int) -> None:
    text = format_budget(nbytes)
    assert parse_memory_budget(text).bytes == nbytes and OSDPStrategy(memory_budget=text).memory_budget_bytes == nbytes


def _tiny_cluster(budget: int) -> ClusterSpec:
    return ClusterSpec(world_size=2, memory_budget_bytes=budget, collective_latency_s=1e-4,
                       bandwidth_bytes_per_s=1e9, headroom_fraction=0.04)


def test_the_budget_an_infeasible_error_names_is_accepted_as_written_and_fits() -> None:
    model = MLP(width=16)
    batch = (torch.randn(8, 16), torch.randn(8, 1))
    profile = profile_lightning_module(model, batch, optimizer=torch.optim.Adam(model.parameters()), repeats=1)
    with pytest.raises(InfeasibleBudgetError) as info:
        make_plan(profile, _tiny_cluster(2**10))
    smallest = int(re.search(r"\((\d+) bytes", str(info.value)).group(1))
    named = re.search(r"memory_budget='([^']+)'", str(info.value)).group(1)
    assert smallest < MIN_BYTES_BUDGET  # the case a bare number would be refused in
    assert parse_memory_budget(named).bytes == smallest
    assert OSDPStrategy(memory_budget=named).memory_budget_bytes == smallest
    assert make_plan(profile, _tiny_cluster(parse_memory_budget(named).bytes)).predicted_peak_bytes <= smallest
    roomier = format_budget(int(1.1 * smallest))
    assert OSDPStrategy(memory_budget=roomier).memory_budget_bytes == int(1.1 * smallest)
    with initialize_config_module(config_module="osdp_lightning.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["cluster=cpu_2", f"cluster.memory_budget={named}"])
    assert instantiate(cfg.strategy, _convert_="all").memory_budget_bytes == smallest
    assert cluster_spec(cfg.cluster).memory_budget_bytes == smallest


def test_a_trainer_refused_for_its_budget_runs_at_the_budget_the_error_names() -> None:
    def fit(budget: str) -> None:
        trainer = L.Trainer(strategy=OSDPStrategy(memory_budget=budget), accelerator="cpu", devices=1, max_steps=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False)
        trainer.fit(MLP(width=16))

    with pytest.raises(InfeasibleBudgetError, match=r"memory_budget='[^']+'") as info:
        fit("1KiB")
    named = re.search(r"memory_budget='([^']+)'", str(info.value)).group(1)
    assert parse_memory_budget(named).bytes < MIN_BYTES_BUDGET
    fit(named)
