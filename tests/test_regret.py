"""The regret benchmark: k-best plans, random plans and the report in-process; one tiny 2-rank ranking run."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
from pathlib import Path

import pytest
from ckpt_launch import run_ranks_in_pool

from benchmarks import compare, regret, regret_report
from benchmarks.regret_candidates import (
    Pricing,
    next_best_candidates,
    osdp_candidate,
    random_assignments,
    uniform_candidates,
)
from osdp_lightning.calibrate import CACHE_ENV
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.choice_table import kept_free_table
from osdp_lightning.profiling.records import ModelProfile, UnitProfile, with_parts
from osdp_lightning.solve import peak_bytes, step_seconds

MIB = 2**20


def _pricing(**headroom: object) -> Pricing:
    """Four units priced as the strategy prices them on CPU (headroom by kind), or with ``headroom``."""
    units = tuple(UnitProfile(name=f"u{i}", module_names=(f"u{i}",), param_count=n, frozen_param_count=0,
                              forward_s=1e-3 * (i + 1), backward_s=2e-3, activation_bytes=1000)
                  for i, n in enumerate((300_000, 100_000, 200_000, 50_000)))
    profile = ModelProfile(units=units, micro_batch_size=2, param_bytes_per_element=4, grad_bytes_per_element=4,
                           compute_bytes_per_element=4, reduce_bytes_per_element=4, optimizer_bytes_per_param=8,
                           activation_bytes=4000)
    cluster = ClusterSpec(world_size=2, memory_budget_bytes=10**9, collective_latency_s=1e-4,
                          bandwidth_bytes_per_s=1e9, **(headroom or {"headroom_by_kind": True}))
    return Pricing.of(profile, cluster)


def _all_fitting(pricing: Pricing, budget: int) -> list[tuple[float, tuple[str, ...]]]:
    """Every plan whose peak as the strategy bounds it fits ``budget``, fastest first."""
    names = [[c.choice for c in unit.choices] for unit in pricing.table.units]
    usable = pricing.usable_bytes(budget)
    plans = [p for p in itertools.product(*names) if peak_bytes(pricing.bounded, p) <= usable]
    return sorted((step_seconds(pricing.table, p), p) for p in plans)


def test_candidates_keep_the_planning_clusters_headroom_rule() -> None:
    """By kind: each choice's bytes grown, all the budget usable; a flat share: the plain table within the rest."""
    by_kind, flat = _pricing(), _pricing(headroom_fraction=0.05)
    assert by_kind.bounded == kept_free_table(by_kind.table) and by_kind.usable_bytes(10**6) == 10**6
    assert flat.bounded == flat.table and flat.usable_bytes(10**6) == 10**6 - 50_000
    zero3 = by_kind.candidate("zero3", "uniform", ("zero3",) * 4, 10**6).plan
    assert zero3.kind_headroom_bytes > 0 and zero3.memory_budget_bytes == 10**6
    assert zero3.bounded_peak_bytes == peak_bytes(by_kind.bounded, ("zero3",) * 4)


def test_next_best_plans_are_the_k_best_after_osdp() -> None:
    pricing = _pricing()
    replicate = uniform_candidates(pricing, 10**9)[0].plan.predicted_peak_bytes
    budget = int(0.8 * replicate)
    expected = _all_fitting(pricing, budget)
    plain = min(itertools.product(*[[c.choice for c in u.choices] for u in pricing.table.units]),
                key=lambda p: (peak_bytes(pricing.table, p) > budget, step_seconds(pricing.table, p)))
    assert peak_bytes(pricing.table, plain) <= budget < peak_bytes(pricing.bounded, plain)  # grown out by kind
    osdp = osdp_candidate(pricing, budget, "80%")
    assert osdp is not None and osdp.plan.predicted_step_s == pytest.approx(expected[0][0])
    found = next_best_candidates(pricing, budget, osdp, 4, "80%")
    assert [c.name for c in found] == [f"next-best {i} @ 80%" for i in range(1, 5)]
    assert len({c.key for c in [osdp, *found]}) == 5
    assert [c.plan.predicted_step_s for c in found] == pytest.approx([s for s, _ in expected[1:5]])


def test_random_plans_fit_differ_and_spread() -> None:
    pricing = _pricing()
    budget = uniform_candidates(pricing, 10**9)[0].plan.predicted_peak_bytes
    plans = random_assignments(pricing.bounded, budget, 8, seed=3)
    assert len(plans) == len(set(plans)) >= 5
    peaks = [peak_bytes(pricing.bounded, p) for p in plans]
    assert max(peaks) <= budget
    assert max(peaks) - min(peaks) > 0.2 * (budget - min(peaks))
    assert plans == random_assignments(pricing.bounded, budget, 8, seed=3)  # seeded


def test_spearman_with_ties() -> None:
    assert regret_report.average_ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert regret_report.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert regret_report.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert regret_report.spearman([1, 2], [1, 2]) is None


def test_spearman_beyond_noise_ties_measured_steps_closer_than_the_noise() -> None:
    # classes start at their fastest step and take what lies within 5% of it: {1.00, 1.04}, {1.20, 1.22}, {1.50}
    assert regret_report.tie_classes([1.20, 1.00, 1.50, 1.04, 1.22], 0.05) == [1.0, 0.0, 2.0, 0.0, 1.0]
    predicted, steps = [0.9, 1.0, 1.1, 1.2], [1.01, 1.00, 1.30, 1.31]  # the near-equal pairs predicted apart
    assert regret_report.spearman(predicted, steps) == pytest.approx(0.8)  # 1 - 6 * 2 / (4 * 15)
    # tied: measured ranks 1.5, 1.5, 3.5, 3.5 against 1..4: 4 / sqrt(5 * 4)
    assert regret_report.spearman_beyond_noise(predicted, steps, 0.05) == pytest.approx(4 / 20 ** 0.5)
    assert regret_report.spearman_beyond_noise(predicted, steps, None) == regret_report.spearman(predicted, steps)
    rows = [{"steps": [1.0, 1.1, 1.05]}, {"steps": [2.0, 2.0]}, {"steps": [1.0, 1.2, 1.1]}, {"steps": [3.0]}]
    assert regret_report.noise_share(rows) == pytest.approx(0.0952, abs=1e-4)  # median of 0.0952, 0, 0.1818


def test_error_sources_split_a_shared_tilt_family_tilts_and_each_plans_own_error() -> None:
    """Predictions 5% slow everywhere, zero2 10% fast, zero3 20% slow and checkpointing 4% slow
    (per whole plan): the fit gives back those tilts and nothing left; rounds 3% either side of the
    median have a standard deviation of 3%, so the standard error of their mean is 3% / sqrt(3)."""
    plans = [["replicate"] * 4, ["zero2"] * 4, ["zero3"] * 4, ["replicate", "zero2", "zero3", "replicate"],
             ["zero2+ckpt", "zero2", "replicate", "replicate"], ["zero3+ckpt", "zero3+ckpt", "zero2", "replicate"],
             ["replicate+ckpt", "replicate", "replicate", "replicate"], ["zero3", "zero3", "zero2", "zero2+ckpt"]]
    rows = []
    for i, choices in enumerate(plans):
        shares = regret_report._plan_shares(choices)
        factor = 1.05 * 0.9 ** shares.get("zero2", 0) * 1.2 ** shares.get("zero3", 0) * 1.04 ** shares.get("+ckpt", 0)
        step = 0.1 + 0.01 * i
        rows.append({"name": f"c{i}", "choices": choices, "predicted_step_s": step * factor,
                     "steps": [step * 0.97, step, step * 1.03]})
    src = regret_report.error_sources(rows)
    assert src is not None and src["candidates"] == 8 and src["reference"] == "replicate"
    assert src["family_tilts"] == pytest.approx({"zero2": -0.10, "zero3": 0.20, "+ckpt": 0.04}, abs=1e-9)
    assert src["residual_share"] == pytest.approx(0.0, abs=1e-9) and src["own_share"] == 0.0
    assert src["measured_share"] == pytest.approx(0.03 / 3**0.5)
    # a plan's own miss stays in the residual, beyond what its rounds' spread explains
    rows[3]["predicted_step_s"] *= 1.3
    noisy = regret_report.error_sources(rows)
    assert noisy["residual_share"] > 0.05
    assert noisy["own_share"] == pytest.approx((noisy["residual_share"] ** 2 - noisy["measured_share"] ** 2) ** 0.5)
    assert regret_report.error_sources(rows[:3]) is None
    assert "| s | too few candidates measured twice |" in regret_report.error_sources_table([({"shape": "s"}, rows[:3])])


def _candidate(name: str, kind: str, predicted_s: float, predicted_peak: int) -> dict:
    return {"name": name, "kind": kind, "choices": ["zero2"], "units": ["u"], "predicted_step_s": predicted_s,
            "predicted_peak_bytes": predicted_peak, "aliases": []}


def _runs(name: str, tokens: tuple[float, float], peak: int) -> list[dict]:
    return [{"candidate": name, "round": r, "status": "ok",
             "summary": {"tokens_per_s": t, "step_s": 1000 / t, "peak_bytes": peak}} for r, t in enumerate(tokens)]


def _shape() -> dict:
    return {"shape": "s", "budgets": {"100%": 100 * MIB}, "settings": {"seq_len": 64}, "units": 1,
            "replicate_peak_bytes": 99 * MIB,
             "candidates": [_candidate("osdp @ 100%", "osdp", 0.10, 90 * MIB),
                            _candidate("replicate", "uniform", 0.09, 110 * MIB),
                            _candidate("random 1 @ 100%", "random", 0.12, 80 * MIB),
                            _candidate("random 2 @ 100%", "random", 0.11, 85 * MIB)],
             "runs": [*_runs("osdp @ 100%", (900, 450), 95 * MIB), *_runs("replicate", (1200, 600), 99 * MIB),
                      *_runs("random 1 @ 100%", (1000, 400), 80 * MIB), *_runs("random 2 @ 100%", (2000, 1000), 101 * MIB)]}


def test_budget_row_pairs_rounds_and_excludes_plans_over_budget() -> None:
    shape = _shape()
    row = regret_report.budget_row(shape, regret_report.measured(shape), "100%", 100 * MIB)
    # replicate's measured peak fits, so it is a candidate although predicted over; random 2 is over budget.
    assert row["candidates"] == 4 and row["fitting"] == 3 and row["over_budget"] == ["random 2 @ 100%"]
    assert row["best"] == "replicate" and row["regret_ratio"] == pytest.approx(0.75)
    assert row["osdp_rank"] == 3  # medians: replicate 900 and random 1 700 beat osdp 675
    text = regret_report.regret_table([row])
    assert "| s | 100% | 100.00 | 3 / 4 | 675 | replicate | 900 | 0.750 | 3 of 3 |" in text


def test_under_process_budgets_a_run_fits_when_its_own_memory_does() -> None:
    shape = {**_shape(), "budget_covers": "process"}
    own = {"osdp @ 100%": 97, "replicate": 104, "random 1 @ 100%": 101, "random 2 @ 100%": 99}
    for run in shape["runs"]:
        run["summary"]["own_above_fixed_bytes"] = own[run["candidate"]] * MIB
    row = regret_report.budget_row(shape, regret_report.measured(shape), "100%", 100 * MIB)
    # replicate's own memory does not fit: no longer a candidate; random 1's tracked peak fits, its own
    # memory does not; random 2's tracked peak is over, its own memory fits
    assert row["candidates"] == 3 and row["fitting"] == 2 and row["over_budget"] == ["random 1 @ 100%"]
    assert row["best"] == "random 2 @ 100%" and row["osdp_fits"] and row["most_of_budget"] == pytest.approx(1.01)
    assert ("- every candidate of a budget within it (measured; own memory under process budgets): MISSED "
            "(highest 101.0% of its budget; 1 over)") in regret_report.verdicts([row])


def _confirmed_shape() -> dict:
    """:func:`_shape` with three confirmation rounds of its finalists; random 1 peaks over the budget in one."""
    shape = _shape()
    shape["confirm"] = {"rounds": 3, "top": 2, "finalists": regret_report.finalists(shape, 2)}
    again = [*_runs("osdp @ 100%", (980, 990, 1000), 95 * MIB), *_runs("replicate", (1000, 1000, 950), 99 * MIB),
             *_runs("random 1 @ 100%", (900, 1100, 1000), 80 * MIB)]
    again[-1]["summary"]["peak_bytes"] = 102 * MIB
    shape["runs"] += [{**run, "stage": regret_report.CONFIRM} for run in again]
    return shape


def test_finalists_are_osdp_and_the_fastest_that_fit_the_screening() -> None:
    # screening medians: replicate 900, random 1 700, osdp 675; random 2 (1500) peaked over the budget
    assert regret_report.finalists(_shape(), 2) == {"100%": ["osdp @ 100%", "replicate", "random 1 @ 100%"]}
    assert regret_report.finalists(_shape(), 1) == {"100%": ["osdp @ 100%", "replicate"]}


def test_confirmed_regret_pairs_the_confirmation_rounds_only() -> None:
    shape = _confirmed_shape()
    screening = regret_report.budget_row(shape, regret_report.measured(shape), "100%", 100 * MIB)
    assert screening["regret_ratio"] == pytest.approx(0.75)  # the confirmation runs leave the screening alone
    row = regret_report.confirmed_row(shape, "100%", 100 * MIB)
    # random 1 went over the budget in a confirmation run; osdp against replicate: 0.98, 0.99, 1.053
    assert row["status"] == "ok" and row["rounds"] == 3 and row["best"] == "replicate"
    assert row["versus"] == {"replicate": pytest.approx(0.99)} and row["regret_ratio"] == pytest.approx(0.99)
    assert "| s | 100% | 3 | 990 | replicate | 1000 | 0.990 | replicate 0.990 |" in regret_report.confirmed_table([row])
    assert regret_report.confirmed_row(_shape(), "100%", 100 * MIB) is None


def test_outputs_are_written(tmp_path: Path) -> None:
    text = regret_report.write_outputs(tmp_path, {"devices": 2, "rounds": 2}, [_shape()], plot=True)
    assert "regret ratio >= 0.97 at every budget: MISSED (lowest 0.750)" in text
    assert (tmp_path / "regret.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "regret_runs.json").read_text())["shapes"][0]["shape"] == "s"
    assert "confirmed" not in text
    text = regret_report.write_outputs(tmp_path, {"devices": 2, "rounds": 2}, [_confirmed_shape()], plot=False)
    assert "regret ratio >= 0.97 at every budget: MISSED (lowest 0.750)" in text
    assert "confirmed regret ratio >= 0.97 at every budget: MET (lowest 0.990)" in text


@pytest.mark.multiprocess
def test_ranks_a_slow_plan_below_all_replicate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny GPT: all-replicate, osdp's plan and all-zero3 with every Linear split in 8 sharded
    slices (24 collectives per Linear), one round on 2 ranks; the slow plan must rank last."""
    monkeypatch.chdir(Path(compare.__file__).parents[1])  # the benchmark's workers run from the checkout
    monkeypatch.setattr(compare, "run_ranks", run_ranks_in_pool)
    # the session's calibrations: the planning launch prices with them, as after --warm-calibrations
    shutil.copytree(os.environ[CACHE_ENV], tmp_path / "calibration", dirs_exist_ok=True)
    (tmp_path / compare.CORPUS_FILE).write_text(Path(compare.__file__).read_text() * 20, encoding="utf-8")
    args = argparse.Namespace(accelerator="cpu", devices=2, seed=0, run_timeout_s=900.0)
    settings = {**compare.PRESETS["tiny"], "steps": 5}
    pricing = regret.plan_shape("tiny", settings, args, tmp_path)
    replicate = uniform_candidates(pricing, pricing.cluster.memory_budget_bytes)[0]
    budget = replicate.plan.predicted_peak_bytes
    parted = Pricing.of(with_parts(pricing.profile, [u.name for u in pricing.profile.units if u.parts]),
                        pricing.cluster)
    slow_choices = tuple(max((c.choice for c in u.choices if c.choice.startswith("split(k=8, sharded=8")),
                             default="zero3") for u in parted.table.units)
    assert sum(c.startswith("split") for c in slow_choices) >= 8  # 4 Linear layers per block, 2 blocks
    candidates = [replicate, osdp_candidate(pricing, budget, "100%"), parted.candidate("slow", "slow", slow_choices, budget)]
    runs = [regret.train(c, 0, settings, args, tmp_path, "tiny") for c in candidates]
    assert all(r["status"] == "ok" for r in runs), [r.get("message", "")[:200] + r.get("message", "")[-1500:] for r in runs]
    shape = {"shape": "tiny", "budgets": {"100%": budget}, "runs": runs,
             "candidates": [{**c.as_dict(), "aliases": []} for c in candidates]}
    rows = {r["name"]: r for r in regret_report.measured(shape)}
    assert rows["slow"]["step_s"] > rows["replicate"]["step_s"]
    row = regret_report.budget_row(shape, list(rows.values()), "100%", budget)
    assert row["status"] == "ok" and row["candidates"] == 3
    ranked = sorted(rows.values(), key=lambda r: -r["tokens_per_s"])
    assert ranked[-1]["name"] == "slow"
    # one confirmation round of osdp's plan and the fastest other that fits, measured apart from the above
    args.confirm_rounds, args.confirm_top = 1, 1
    regret.confirm(shape, candidates, settings, args, tmp_path, lambda _: None)
    again = [r for r in shape["runs"] if r["stage"] == regret_report.CONFIRM]
    assert sorted(r["candidate"] for r in again) == sorted(shape["confirm"]["finalists"]["100%"])
    assert all(r["status"] == "ok" for r in again)
    confirmed = regret_report.confirmed_row(shape, "100%", budget)
    assert confirmed["status"] == "ok" and confirmed["rounds"] == 1
