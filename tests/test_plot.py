"""The plan picture: a real small plan, a synthetic 300-unit plan, old plan files, no matplotlib."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.measure import profile_lightning_module
from osdp_lightning.plan.plan import BaselinePrediction, Plan, UnitPlan, make_plan
from osdp_lightning.report.plot import group_units, plot_plan, try_plot_plan

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from toy_models import MLP  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def mlp_plan() -> Plan:
    """A solved plan of a real profile, at a budget between the zero3 and the zero2 peak."""
    model = MLP(width=64)
    batch = (torch.randn(8, 64), torch.randn(8, 1))
    profile = profile_lightning_module(model, batch, optimizer=torch.optim.Adam(model.parameters()), repeats=1)
    cluster = ClusterSpec(world_size=2, memory_budget_bytes=2**30, collective_latency_s=1e-4,
                          bandwidth_bytes_per_s=1e9)
    peaks = {b.choice: b.peak_bytes for b in make_plan(profile, cluster).baselines}
    budget = (peaks["zero2"] + peaks["zero3"]) // 2
    return make_plan(profile, dataclasses.replace(cluster, memory_budget_bytes=budget))


def synthetic_plan(blocks: int) -> Plan:
    """An embedding, ``blocks`` transformer blocks of 4 Linear units (two choice patterns), a root."""
    units = [UnitPlan("net.wte", ("net.wte",), 38_000_000, "zero2", 0, 0.01, state_bytes=300 << 20,
                      held_bytes=150 << 20, transient_bytes=150 << 20, compute_s=0.02, comm_s=0.01)]
    for b in range(blocks):
        for leaf, params in (("attn.c_attn", 1_770_000), ("attn.c_proj", 590_000), ("mlp.c_fc", 2_360_000),
                             ("mlp.c_proj", 2_360_000)):
            choice = "zero3" if b < blocks // 2 else ("split(k=4, sharded=3)" if leaf == "mlp.c_fc" else "zero2")
            units.append(UnitPlan(f"net.h.{b}.{leaf}", (f"net.h.{b}.{leaf}",), params, choice, 0, 1e-3,
                                  state_bytes=8 * params, held_bytes=0 if choice == "zero3" else 4 * params,
                                  transient_bytes=8 * params, activation_bytes=params // 2, compute_s=1e-9 * params,
                                  comm_s=2e-10 * params, optimizer_s=1e-10 * params, overhead_s=1e-4))
    units.append(UnitPlan("", ("",), 0, "replicate", 0, 0.0))
    peak = sum(u.state_bytes + u.held_bytes + u.activation_bytes for u in units) + (400 << 20)
    return Plan(units=tuple(units), world_size=8, micro_batch_size=4, memory_budget_bytes=int(peak * 1.06),
                predicted_peak_bytes=peak, predicted_step_s=1.0, predicted_throughput=32.0,
                activation_bytes=400 << 20, solver_status="Optimal",
                baselines=(BaselinePrediction("replicate", int(peak * 1.8), 0.9, False),
                           BaselinePrediction("zero3", int(peak * 0.8), 1.2, True)))


def test_a_small_real_plan_draws_one_bar_per_unit(mlp_plan: Plan, tmp_path: Path) -> None:
    assert {b.choice: b.fits for b in mlp_plan.baselines} == {"replicate": False, "zero2": False, "zero3": True}
    assert [b.label for b in group_units(mlp_plan)] == [u.name or "<root>" for u in mlp_plan.units]
    # the per-unit breakdown adds up to the unit's bytes, and the seconds to the predicted step
    for unit in mlp_plan.units:
        assert unit.state_bytes + unit.held_bytes + unit.transient_bytes == unit.predicted_bytes
    unit_s = sum(u.compute_s + u.comm_s + u.optimizer_s + u.overhead_s for u in mlp_plan.units)
    loop_s = getattr(mlp_plan, "predicted_loop_s", 0.0)  # the step's per-step constant, in no unit
    assert unit_s + loop_s == pytest.approx(mlp_plan.predicted_step_s, rel=1e-6)
    path = plot_plan(mlp_plan, tmp_path / "plan.png")
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_a_300_unit_plan_groups_runs_of_identical_blocks(tmp_path: Path) -> None:
    plan = synthetic_plan(74)
    assert len(plan.units) == 298
    bars = group_units(plan)
    assert [b.label for b in bars] == ["net.wte", "net.h.0-36 (x37)", "net.h.37-73 (x37)", "<root>"]
    assert sum(b.kept_bytes for b in bars) == sum(u.state_bytes + u.held_bytes + u.activation_bytes
                                                  for u in plan.units)
    path = plot_plan(plan, tmp_path / "plan.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_distinct_blocks_get_a_bar_each_and_too_many_fall_back_to_ranges_of_units() -> None:
    for blocks, bar_count in ((60, 62), (120, 44)):  # 2 + blocks bars, or ranges of 11 units
        plan = synthetic_plan(blocks)
        units = tuple(dataclasses.replace(u, param_count=u.param_count + i) for i, u in enumerate(plan.units))
        bars = group_units(dataclasses.replace(plan, units=units))
        assert len(bars) == bar_count and sum(b.count for b in bars) == len(units)


def test_a_plan_saved_before_the_breakdown_loads_and_draws(mlp_plan: Plan, tmp_path: Path) -> None:
    data = mlp_plan.to_dict()
    data.pop("baselines"), data.pop("fixed_bytes")
    new_fields = ("state_bytes", "held_bytes", "transient_bytes", "activation_bytes", "compute_s", "comm_s",
                  "optimizer_s", "overhead_s")
    data["units"] = [{k: v for k, v in u.items() if k not in new_fields} for u in data["units"]]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "old.json")
    assert old.baselines == () and old.units[0].state_bytes == 0
    assert try_plot_plan(old, tmp_path / "old.png") == f"plan picture: {tmp_path / 'old.png'}"


def test_without_matplotlib_one_line_says_how_to_get_the_picture(mlp_plan: Plan, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    line = try_plot_plan(mlp_plan, tmp_path / "plan.png")
    assert line.startswith("plan picture: not drawn") and "pip install 'osdp_lightning[plot]'" in line
    assert "\n" not in line and not (tmp_path / "plan.png").exists()
