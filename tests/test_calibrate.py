"""Step-time terms: calibration on 2 real ranks, the per-machine cache, and the cost model using them."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch
from ckpt_launch import run_ranks, script

from osdp_lightning.calibrate import (
    BUSY_CPU_SHARE,
    CACHE_DRAWS,
    CACHE_ENV,
    CACHE_FORMAT,
    busy_reason,
    cache_file,
    median_terms,
    read_cache,
    write_cache,
)
from osdp_lightning.calibrate import fit as fitting
from osdp_lightning.choices.split import SPLIT_REPLICATED
from osdp_lightning.step_terms import (
    GROUP_TERMS,
    PLAIN,
    Affine,
    StepTerms,
    step_terms_from_config,
)

KEY = {"format": CACHE_FORMAT, "host": "h", "torch": "2.13.0", "backend": "gloo", "device": "cpu", "world_size": 2,
       "ranks_per_node": 2, "split": True, "optimizer": "torch.optim.adamw.AdamW", "optimizer_flags": {}}


def some_terms() -> StepTerms:
    return StepTerms(collectives={k: Affine(1e-4, 1e-9) for k in ("all_gather", "reduce_scatter", "all_reduce")},
                     overhead={k: Affine(1e-3, 2e-9) for k in GROUP_TERMS},
                     optimizer={k: Affine(1e-5, 1e-9) for k in (*GROUP_TERMS, PLAIN)}, loop_step_s=4e-3)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return cache_file(KEY)


def test_cache_is_written_and_read_back(cache: Path) -> None:
    assert read_cache(cache, KEY) is None  # nothing there yet: no note, just measure
    write_cache(cache, KEY, [some_terms()])
    back = read_cache(cache, KEY)
    assert back is not None and len(back) == 1
    assert back[0].to_dict()["collectives"] == some_terms().to_dict()["collectives"]
    assert back[0].overhead == some_terms().overhead and back[0].source.startswith("cache ")
    draws = [scaled(some_terms(), f) for f in (1.0, 2.0, 3.0, 4.0)]
    write_cache(cache, KEY, draws)  # only the latest CACHE_DRAWS are kept
    assert [d.overhead["zero3"] for d in read_cache(cache, KEY)] == [d.overhead["zero3"] for d in draws[-CACHE_DRAWS:]]


def scaled(terms: StepTerms, factor: float) -> StepTerms:
    def table(part: dict[str, Affine]) -> dict[str, Affine]:
        return {k: Affine(v.constant_s * factor, v.per_byte_s * factor) for k, v in part.items()}
    return dataclasses.replace(terms, collectives=table(terms.collectives), overhead=table(terms.overhead),
                               optimizer=table(terms.optimizer), extra={"factor": factor})


def test_the_median_of_calibrations_ignores_one_outlier_in_each_term() -> None:
    """One calibration's zero3 constant 50% high (the failure this guards against), another's all-gather
    rate 4x: the median takes neither; each constant and each rate is the median of its own."""
    base = some_terms()
    high_zero3 = dataclasses.replace(base, overhead={**base.overhead, "zero3": Affine(1.5e-3, 2e-9)})
    fast_gather = dataclasses.replace(base, collectives={**base.collectives, "all_gather": Affine(1e-4, 4e-9)},
                                      extra={"calibrate_cpu_share": 0.8})
    median = median_terms([high_zero3, base, fast_gather], source="test")
    assert median.overhead == base.overhead and median.collectives == base.collectives
    assert median.optimizer == base.optimizer and median.source == "test"
    assert median.extra == {"calibrate_cpu_share": 0.8, "calibration_draws": 3.0}  # the latest draw's raw figures
    two = median_terms([base, scaled(base, 3.0)], source="test")  # two: their mean
    assert two.overhead["zero2"].constant_s == pytest.approx(2 * base.overhead["zero2"].constant_s)


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "negative", "empty", "foreign", "old_format", "too_old"])
def test_a_bad_cache_is_ignored_with_one_line(cache: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    write_cache(cache, KEY, [some_terms()])
    data = json.loads(cache.read_text())
    if damage == "corrupt":
        cache.write_text("{not json")
    elif damage == "truncated":
        cache.write_text(cache.read_text()[:200])
    else:
        if damage == "negative":
            data["draws"][0]["overhead"]["zero3"] = [-1.0, 0.0]
        elif damage == "empty":
            data["draws"] = []
        elif damage == "foreign":
            data["key"]["torch"] = "2.5.0"
        elif damage == "old_format":
            data["key"]["format"] = CACHE_FORMAT - 1
        else:
            data["written_at"] = time.time() - 30 * 86400
        cache.write_text(json.dumps(data))
    with caplog.at_level("INFO"):
        assert read_cache(cache, KEY) is None
    notes = [r.getMessage() for r in caplog.records if "calibration cache" in r.getMessage()]
    assert len(notes) == 1, notes
    expected = {"corrupt": "corrupt", "truncated": "corrupt", "negative": "corrupt", "empty": "corrupt",
                "foreign": "foreign (measured for another torch", "old_format": "stale", "too_old": "stale"}[damage]
    assert expected in notes[0]


def test_the_fits_recover_a_line_and_never_go_negative() -> None:
    line = [(x, 2e-4 + 1e-9 * x) for x in (6.4e4, 1e6, 4e6, 1.6e7)]
    fit = Affine.fit(line, 1)
    assert fit.constant_s == pytest.approx(2e-4) and fit.per_byte_s == pytest.approx(1e-9)
    assert Affine.fit(line, 4).constant_s == pytest.approx(5e-5)  # the constant is per counted item
    # A collective's constant is its smallest size's time, so a slow largest size moves the rate,
    # not the latency, and a fast one cannot push the constant below 0.
    slow_top = [*line[:-1], (1.6e7, 2e-4 + 1.5e-9 * 1.6e7)]
    collective = fitting._collective_fit(slow_top)
    assert collective.per_byte_s > 1e-9
    assert collective.constant_s == pytest.approx(max(line[0][1] - collective.per_byte_s * 6.4e4, 0.0))
    assert Affine.fit([(1.0, 3.0), (2.0, 1.0)], 1) == Affine(2.0, 0.0)  # falling: rate 0
    assert fitting._collective_fit([(1e6, 1e-4), (2e6, 1e-2)]).constant_s == 0.0


def test_cluster_configs_give_complete_terms() -> None:
    from osdp_lightning.cluster import cluster_config_dir, load_cluster_config

    for path in sorted(cluster_config_dir().glob("*.yaml")):
        terms = step_terms_from_config(load_cluster_config(path))
        assert terms.is_valid(), path.name
        assert terms.collective_s("all_gather", 2**20, 8) > terms.collective_s("all_gather", 2**10, 8) > 0


@pytest.mark.multiprocess
def test_calibration_on_two_ranks_is_positive_identical_and_cached_unless_busy(tmp_path: Path) -> None:
    """Four calls on 2 real ranks, the cache keeping 2 calibrations: measured and cached; measured
    again and taken with the cached one (their median); read back (the median of the two); and,
    with the busy threshold above any share of a core, measured and not cached."""
    out = tmp_path / "calib"
    done = run_ranks([script("calibrate_check.py"), "--out", str(out)], tmp_path / "log", 240, cwd=tmp_path,
                     env={CACHE_ENV: str(tmp_path / "cache")})
    assert done.returncode == 0, done.log[-9000:]
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    first, second, third, fourth = (ranks[0][k] for k in ("first", "second", "third", "fourth"))
    assert ranks[1] == ranks[0], "ranks calibrated different terms"
    shares = [call["extra"]["calibrate_cpu_share"] for call in (first, second)]
    assert all(0 < share <= 1.05 for share in shares), shares
    assert first["source"] == "measured at setup"
    if min(shares) >= BUSY_CPU_SHARE:  # a quiet machine: both cached, then read back as their median
        assert ranks[0]["cached_after_first"] == ["step_terms_cpu_w2_r2.json"]
        assert second["source"] == "measured at setup, median with 1 cached"
        assert third["source"].startswith("cache ") and third["source"].endswith("(median of 2 calibrations)")
        assert third["calibrate_s"] == 0 < second["calibrate_s"]
        for part in ("collectives", "overhead", "optimizer"):
            assert third[part] == second[part]
    elif shares[0] < BUSY_CPU_SHARE:  # a busy first call (another job on this machine): never cached
        assert ranks[0]["cached_after_first"] == []
    assert fourth["source"] == "measured at setup"
    assert ranks[0]["cached_after_fourth"] == [], "terms measured on a busy machine were cached"
    assert "step terms not cached: the machine was busy" in done.log
    terms = StepTerms.from_dict(first)  # raises on anything missing, negative or not finite
    # NOTE: one part of a fit may come out 0 (the sizes' timings within noise of each other),
    # but a collective or an optimizer step is a measured time, never less than the smaller
    # size's, so its priced cost is positive. FSDP2's overhead is what is left after the modelled
    # collectives are taken off, and the fit clamps it at 0 when noise leaves nothing: it is only
    # ever finite and non-negative (a timing assertion beyond that fails on a loaded machine).
    for kind, cost in terms.collectives.items():
        assert cost.is_valid() and cost.seconds(1, 2**20) > 0, kind
    for kind, cost in terms.overhead.items():
        assert cost.is_valid(), kind
    for kind, cost in terms.optimizer.items():  # a replicated slice's is a difference too (clamped at 0)
        assert cost.is_valid() and (kind == SPLIT_REPLICATED or cost.seconds(2, 2**20) > 0), kind
    assert 0 < first["calibrate_s"] and math.isfinite(first["calibrate_s"])
    print(f"calibrate_s {first['calibrate_s']:.2f}")


def test_terms_measured_on_a_busy_cpu_are_not_cached() -> None:
    terms = step_terms_from_config({"accelerator": "cpu", "intra_node_latency_s": 1e-4,
                                    "intra_node_bandwidth_bytes_per_s": 1e9})
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert busy_reason(terms, cpu) is None  # nothing measured: nothing to judge
    for share, busy in ((0.5, True), (BUSY_CPU_SHARE - 0.01, True), (BUSY_CPU_SHARE, False), (0.8, False)):
        measured = dataclasses.replace(terms, extra={"calibrate_cpu_share": share})
        reason = busy_reason(measured, cpu)
        assert (reason is not None) == busy, (share, reason)
        assert busy_reason(measured, cuda) is None  # CUDA ranks wait for the device, not for cores
    assert "a rank got 50% of a core" in busy_reason(dataclasses.replace(terms, extra={"calibrate_cpu_share": 0.5}), cpu)


def test_step_terms_enter_the_predicted_step() -> None:
    from osdp_lightning.cluster import ClusterSpec
    from osdp_lightning.plan import make_plan
    from osdp_lightning.profile import ModelProfile, UnitProfile

    width, world = 256, 2
    sizes = [width * width + width] * 3 + [2 * width]  # three Linear units, a root holding a norm
    units = tuple(UnitProfile(f"l{i}", (f"l{i}",), n, 0, 0.01, 0.02, 1000, tensor_count=2) for i, n in enumerate(sizes))
    profile = ModelProfile(units=(*units[:-1], dataclasses.replace(units[-1], name="", module_names=("",))),
                           micro_batch_size=2, param_bytes_per_element=4, grad_bytes_per_element=4,
                           compute_bytes_per_element=4, reduce_bytes_per_element=4, optimizer_bytes_per_param=8,
                           activation_bytes=10_000)
    plain = ClusterSpec(world_size=world, memory_budget_bytes=2**40, collective_latency_s=1e-4,
                        bandwidth_bytes_per_s=1e9)
    terms = dataclasses.replace(some_terms(), collectives={"all_gather": Affine(1e-4, 1e-9),
                                                           "reduce_scatter": Affine(2e-4, 3e-9),
                                                           "all_reduce": Affine(3e-4, 4e-9)})
    priced = dataclasses.replace(plain, step_terms=terms)

    def comm_s(choice: str, nbytes: int) -> float:  # each kind at its own measured cost
        gather, scatter = (terms.collective_s(k, nbytes, world) for k in ("all_gather", "reduce_scatter"))
        return {"replicate": terms.collective_s("all_reduce", nbytes, world), "zero2": gather + scatter,
                "zero3": 2 * gather + scatter}[choice]

    for choice in ("replicate", "zero2", "zero3"):
        before = make_plan(profile, plain, uniform_choice=choice)
        after = make_plan(profile, priced, uniform_choice=choice)
        overhead = sum(terms.overhead_s(choice, 1, 4 * n) for n in sizes)
        optimizer = sum(terms.optimizer_s(choice, 2, 4 * n) for n in sizes)
        comm = sum(comm_s(choice, 4 * n) for n in sizes)
        assert after.predicted_overhead_s == pytest.approx(overhead) and overhead > 0
        assert after.predicted_optimizer_s == pytest.approx(optimizer) and optimizer > 0
        assert after.predicted_exposed_comm_s == pytest.approx(comm)
        assert after.predicted_loop_s == terms.loop_step_s
        assert after.predicted_compute_s == pytest.approx(before.predicted_compute_s) == pytest.approx(0.12)
        assert after.predicted_step_s == pytest.approx(0.12 + optimizer + overhead + comm + terms.loop_step_s)
        assert before.predicted_overhead_s == before.predicted_optimizer_s == before.predicted_loop_s == 0.0
        assert "optimizer" in after.format_table() and after.step_terms_source == "defaults"
