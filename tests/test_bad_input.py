"""Every bad input gets a clear error before training starts: what was wrong and what would work.

In-process and fast. Covered elsewhere: ``devices=1`` (a single-device plan with a note; run e
of tests/test_resume.py) and a rank failing during setup (tests/test_fault.py).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import threading
from pathlib import Path

import highspy
import lightning as L
import pulp
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import MissingConfigException

from osdp_lightning import InfeasibleBudgetError, OSDPStrategy, PlanMismatchError, make_plan
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.choice_table import build_choice_table
from osdp_lightning.plan.measure import profile_lightning_module
from osdp_lightning.profiling.units import select_units
from osdp_lightning.runtime.split import SplitLinear, split_linear_in_module
from osdp_lightning.solve import SolverUnavailableError, smallest_feasible_budget, solvers

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_launch import run_ranks, script  # noqa: E402
from ckpt_plans import MIXED, fixed_plan  # noqa: E402
from toy_models import MLP, TiedLM  # noqa: E402


def cluster(budget: int) -> ClusterSpec:
    return ClusterSpec(world_size=2, memory_budget_bytes=budget, collective_latency_s=1e-4,
                       bandwidth_bytes_per_s=1e9)


@pytest.fixture(scope="module")
def mlp_profile():
    model = MLP(width=32)
    batch = (torch.randn(8, 32), torch.randn(8, 1))
    return profile_lightning_module(model, batch, optimizer=torch.optim.Adam(model.parameters()), repeats=1)


# -- budgets --------------------------------------------------------------------------------------
def test_a_budget_below_the_smallest_feasible_names_that_budget(mlp_profile) -> None:
    with pytest.raises(InfeasibleBudgetError, match=r"smallest budget that fits is .*\(\d+ bytes") as info:
        make_plan(mlp_profile, cluster(1000))
    smallest = int(re.search(r"\((\d+) bytes", str(info.value)).group(1))
    assert make_plan(mlp_profile, cluster(smallest)).predicted_peak_bytes <= smallest  # and it does fit


@pytest.mark.parametrize("budget, message", [
    (-1, "must be positive"), (0, "must be positive"), ("0GiB", "must be positive"), (float("nan"), "positive"),
    ("lots", "cannot read memory budget 'lots'.*'8GiB'"), ("8XB", "cannot read"), ("", "cannot read"),
    (True, "must be a size")])
def test_unusable_budgets_are_refused_with_the_accepted_forms(budget: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OSDPStrategy(memory_budget=budget)


# -- plan files -----------------------------------------------------------------------------------
def test_a_plan_for_another_model_or_world_size_says_what_differs(tmp_path: Path) -> None:
    fixed_plan(MLP(width=64), 2, MIXED).save(tmp_path / "plan.json")
    plan = OSDPStrategy(plan=tmp_path / "plan.json").config.plan
    with pytest.raises(PlanMismatchError, match="world size: plan 2, run 4"):
        plan.check_matches(MLP(width=64), 4)
    with pytest.raises(PlanMismatchError, match="unit 'net.0': plan has 4160 parameters, model has 1056"):
        plan.check_matches(MLP(width=32), 2)
    with pytest.raises(PlanMismatchError, match="modules this model does not have"):
        plan.check_matches(TiedLM(), 2)


@pytest.mark.parametrize("text", ["{not json", '{"units": []}', '{"units": [{"name": "x"}], "world_size": 2}', ""])
def test_a_corrupt_plan_file_is_refused(tmp_path: Path, text: str) -> None:
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(ValueError, match="is not a valid osdp plan JSON.*Plan.save"):
        OSDPStrategy(plan=tmp_path / "plan.json")


def test_unknown_choice_names_in_a_plan_are_listed(tmp_path: Path) -> None:
    data = fixed_plan(MLP(width=64), 2, MIXED).to_dict()
    data["units"][1]["choice"] = "zero4"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"unknown choices \['zero4'\]; known choices are .*'zero3'"):
        OSDPStrategy(plan=tmp_path / "plan.json")


# -- models ---------------------------------------------------------------------------------------
def test_unit_patterns_that_match_nothing_list_what_exists() -> None:
    with pytest.raises(ValueError, match=r"match no module of MLP; module types present: \['Linear', 'ReLU'"):
        select_units(MLP(), unit_name_patterns=["encoder.layers.*"])


def test_a_model_without_trainable_parameters_is_refused() -> None:
    model = MLP(width=32).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters.*requires_grad=True"):
        profile_lightning_module(model, (torch.randn(4, 32), torch.randn(4, 1)), repeats=1)


def test_frozen_parameters_cost_no_gradient_or_optimizer_state() -> None:
    model = MLP(width=32)
    model.net[0].requires_grad_(False)
    batch = (torch.randn(8, 32), torch.randn(8, 1))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    profile = profile_lightning_module(model, batch, optimizer=optimizer, repeats=1)
    frozen = next(u for u in profile.units if u.name == "net.0")
    assert (frozen.param_count, frozen.frozen_param_count) == (0, 32 * 32 + 32)
    table = build_choice_table(profile, cluster(2**30))
    frozen_costs, trainable_costs = (next(u for u in table.units if u.name == n) for n in ("net.0", "net.2"))
    per_param = profile.grad_bytes_per_element + profile.optimizer_bytes_per_param  # 4 + 8 (fp32 Adam)
    for choice, share in (("replicate", 1), ("zero3", 2)):  # same shape; the frozen one lacks grad + Adam state
        saved = trainable_costs.cost_of(choice).state_bytes - frozen_costs.cost_of(choice).state_bytes
        assert saved == frozen.frozen_param_count * per_param // share


@pytest.mark.multiprocess
def test_frozen_parameters_train_and_checkpoint_on_two_ranks(tmp_path: Path) -> None:
    done = run_ranks([script("ckpt_run.py"), "--frozen", "--steps", "6", "--budget", "1GiB", "--ckpt-dir",
                      "ckpt", "--ckpt-every", "3", "--out", "out"], tmp_path / "log", 240, cwd=tmp_path)
    assert done.returncode == 0, done.log[-6000:]
    final = torch.load(tmp_path / "out" / "final.pt", weights_only=False)
    L.seed_everything(0)
    initial = MLP(width=64).state_dict()  # the script's model, built after the same seed
    assert torch.equal(final["model"]["net.0.weight"], initial["net.0.weight"])  # frozen: untouched
    assert not torch.equal(final["model"]["net.2.weight"], initial["net.2.weight"])
    assert not any(k.startswith("net.0.") for k in final["optimizers"][0]["state"])  # no optimizer state
    assert (tmp_path / "ckpt" / "step=6.ckpt" / "osdp_checkpoint.json").is_file()


# -- solver ---------------------------------------------------------------------------------------
def test_a_missing_solver_says_how_to_install_it(mlp_profile, monkeypatch: pytest.MonkeyPatch) -> None:
    table = build_choice_table(mlp_profile, cluster(2**30))
    monkeypatch.setattr(pulp.PULP_CBC_CMD, "available", lambda self: False)
    with pytest.raises(SolverUnavailableError, match="pip install --force-reinstall highspy pulp"):
        smallest_feasible_budget(table, solver="cbc")
    monkeypatch.setattr(solvers, "highs_installed", lambda: False)
    with pytest.raises(SolverUnavailableError, match="`highspy` is not installed: run `pip install highspy`"):
        smallest_feasible_budget(table, solver="highs")


def test_without_highspy_cbc_solves_and_says_so_once(mlp_profile, monkeypatch: pytest.MonkeyPatch) -> None:
    table = build_choice_table(mlp_profile, cluster(2**30))
    monkeypatch.setattr(solvers, "highs_installed", lambda: False)
    monkeypatch.setattr(solvers, "_warned_fallback", threading.Event())
    monkeypatch.delenv(solvers.SOLVER_ENV, raising=False)
    with pytest.warns(UserWarning, match=r"highspy is not installed, solving with CBC .*pip install highspy") as seen:
        first = smallest_feasible_budget(table)
        second = smallest_feasible_budget(table)
    assert first == second and len([w for w in seen if "highspy" in str(w.message)]) == 1


def test_a_failing_solver_says_what_failed(mlp_profile, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise pulp.PulpSolverError("Pulp: Error while executing cbc")

    table = build_choice_table(mlp_profile, cluster(2**30))
    monkeypatch.setattr(pulp.LpProblem, "solve", crash)
    with pytest.raises(SolverUnavailableError, match="CBC solver failed: Pulp: Error while executing"):
        smallest_feasible_budget(table, solver="cbc")
    monkeypatch.setattr(highspy.Highs, "getModelStatus", lambda self: highspy.HighsModelStatus.kSolveError)
    with pytest.raises(SolverUnavailableError, match=r"HiGHS solver failed \(.*\); install the solvers again"):
        smallest_feasible_budget(table, solver="highs")


def test_without_pulp_the_import_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The solvers module (``import osdp_lightning`` imports it, through plan and solve) run afresh,
    under another name, where ``import pulp`` fails: this process's own modules stay as they are."""
    monkeypatch.setitem(sys.modules, "pulp", None)
    spec = importlib.util.spec_from_file_location("solvers_without_pulp", solvers.__file__)
    assert spec is not None and spec.loader is not None
    with pytest.raises(ImportError, match="pip install pulp"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# -- recipes and sizes ----------------------------------------------------------------------------
@pytest.mark.parametrize("override, listed", [("model=gpt_huge", "gpt_tiny"), ("cluster=tpu_v9", "cpu_2")])
def test_an_unknown_recipe_name_lists_the_options(override: str, listed: str) -> None:
    with initialize_config_module("osdp_lightning.conf", version_base="1.3"):
        with pytest.raises(MissingConfigException, match=f"(?s)Available options in .*{listed}"):
            compose("train", overrides=["output_dir=/tmp/unused", override])


def test_a_split_factor_that_does_not_divide_the_layer_names_the_ones_that_do() -> None:
    with pytest.raises(ValueError, match=r"cannot split in_features=10 into k=3.*valid k for in_features=10: 2, 5, 10"):
        SplitLinear(10, 4, k=3)
    with pytest.raises(ValueError, match="in_features=64 into k=3"):
        split_linear_in_module(MLP(width=64), "net.0", 3)  # what applying a plan with split(k=3) does
    with pytest.raises(ValueError, match="split_factors must be integers >= 2"):
        OSDPStrategy(split_factors=(1, 2))


@pytest.mark.parametrize("kwargs, message", [({"micro_batch_size": 0}, "positive int, 'auto' or None"),
                                             ({"uniform_choice": "zero4"}, "is not one of")])
def test_other_strategy_arguments_are_checked_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OSDPStrategy(**kwargs)
