"""Step-time terms: calibration on 2 real ranks, the per-machine cache, and the cost model using them."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from ckpt_launch import run_ranks, script
from toy_models import MLP

from osdp_lightning import OSDPStrategy
from osdp_lightning.calibrate import (
    BUSY_CPU_SHARE,
    CACHE_DRAWS,
    CACHE_ENV,
    CACHE_FORMAT,
    DRAWS_ENV,
    busy_reason,
    cache_draws,
    cache_file,
    measure_one_process_terms,
    median_terms,
    read_cache,
    write_cache,
)
from osdp_lightning.calibrate import fit as fitting
from osdp_lightning.calibrate.bench import rotated
from osdp_lightning.choices.split import SPLIT_REPLICATED
from osdp_lightning.cost.budget import format_bytes
from osdp_lightning.cost.links import LINK_PAYLOAD_BYTES, link_probe_bytes
from osdp_lightning.cost.step_terms import (
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


def test_each_key_has_a_file_and_the_draws_can_be_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs with another optimizer keep calibrations of their own (they used to replace each other's)."""
    sgd = {**KEY, "optimizer": "torch.optim.sgd.SGD"}
    assert cache_file(KEY) != cache_file(sgd) and cache_file(KEY) == cache_file(dict(KEY))
    assert re.fullmatch(r"step_terms_cpu_w2_r2_[0-9a-f]{8}\.json", cache_file(KEY).name)
    monkeypatch.delenv(DRAWS_ENV, raising=False)
    assert cache_draws() == CACHE_DRAWS == 5
    monkeypatch.setenv(DRAWS_ENV, "1")
    assert cache_draws() == 1
    monkeypatch.setenv(DRAWS_ENV, "0")
    with pytest.raises(ValueError, match=f"{DRAWS_ENV}='0': expected a positive number of calibrations"):
        cache_draws()


def test_cache_is_written_and_read_back(cache: Path) -> None:
    assert read_cache(cache, KEY) is None  # nothing there yet: no note, just measure
    write_cache(cache, KEY, [some_terms()])
    back = read_cache(cache, KEY)
    assert back is not None and len(back) == 1
    assert back[0].to_dict()["collectives"] == some_terms().to_dict()["collectives"]
    assert back[0].overhead == some_terms().overhead and back[0].source.startswith("cache ")
    draws = [scaled(some_terms(), 1.0 + f) for f in range(CACHE_DRAWS + 2)]
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


def test_terms_timed_with_gloos_own_reduce_scatter_are_not_reused() -> None:
    assert CACHE_FORMAT == 5  # format 4: gloo's reduce-scatter; 3: bare Linear stacks, nothing between the collectives


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
        elif damage == "old_format":  # bare Linear stacks' terms (format 3) over-priced zero3
            data["key"]["format"] = 3
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
    from osdp_lightning.cost.cluster import cluster_config_dir, load_cluster_config

    for path in sorted(cluster_config_dir().glob("*.yaml")):
        terms = step_terms_from_config(load_cluster_config(path))
        assert terms.is_valid(), path.name
        assert terms.collective_s("all_gather", 2**20, 8) > terms.collective_s("all_gather", 2**10, 8) > 0


@pytest.mark.multiprocess
def test_calibration_on_two_ranks_is_positive_identical_and_cached_unless_busy(tmp_path: Path) -> None:
    """Six calls on 2 real ranks, the cache keeping 2 calibrations: measured and cached; measured
    again and taken with the cached one (their median); read back (the median of the two); with the
    busy threshold above any share of a core, measured and not cached; within the least room a
    calibration can take, measured one pair of benches at a time and held within it; within a byte
    less, refused. Ranks holding models of different sizes get one room, beside the larger."""
    out = tmp_path / "calib"
    done = run_ranks([script("calibrate_check.py"), "--out", str(out)], tmp_path / "log", 240, cwd=tmp_path,
                     env={CACHE_ENV: str(tmp_path / "cache"), DRAWS_ENV: "",  # the script sets 2
                          # NOTE: freed tensors go back to the system, so that the high-water's growth is the
                          # calibration's; malloc reads this at interpreter start, hence fresh ranks, not the pool's
                          "MALLOC_MMAP_THRESHOLD_": "65536"}, isolated=True)
    assert done.returncode == 0, done.log[-9000:]
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    first, second, third, fourth = (ranks[0][k] for k in ("first", "second", "third", "fourth"))
    own = {"fifth_grown", "probe_grown", "held_bytes"}  # each rank's own high-water and model
    assert {k: v for k, v in ranks[1].items() if k not in own} == {k: v for k, v in ranks[0].items() if k not in own}, \
        "ranks calibrated different terms"
    shares = [call["extra"]["calibrate_cpu_share"] for call in (first, second)]
    assert all(0 < share <= 1.05 for share in shares), shares
    assert first["source"] == "measured at setup"
    if min(shares) >= BUSY_CPU_SHARE:  # a quiet machine: both cached, then read back as their median
        (name,) = ranks[0]["cached_after_first"]
        assert re.fullmatch(r"step_terms_cpu_w2_r2_[0-9a-f]{8}\.json", name)
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
    benches = [key.removesuffix("_step_s") for key in first["extra"] if key.endswith("_step_s")]
    assert len(benches) == 6 * 3, benches  # local, replicate, zero2, zero3, split's reference and bench; 3 widths
    for bench in benches:  # forward and backward timed apart: the model's overlap reads both
        assert 0 < first["extra"][f"{bench}_forward_s"] < first["extra"][f"{bench}_step_s"], bench
    assert 0 < first["calibrate_s"] and math.isfinite(first["calibrate_s"])
    # within one pair's room: one pair of benches at a time, every bench timed, the process held within it
    fifth = ranks[0]["fifth"]
    assert fifth["extra"]["calibrate_groups"] == 4 * 3 and StepTerms.from_dict(fifth).is_valid()
    assert {k for k in fifth["extra"] if k.endswith("_step_s")} == {f"{b}_step_s" for b in benches}
    for rank in ranks:  # the link probe too holds at most what it is bounded by
        assert rank["fifth_grown"] <= rank["least_room"], (rank["fifth_grown"], rank["least_room"])
        assert rank["probe_grown"] <= link_probe_bytes(LINK_PAYLOAD_BYTES, 2), rank["probe_grown"]
    assert "in 12 groups, each freed before the next" in done.log
    # the room is the budget less the larger of the ranks' models, on both ranks
    assert ranks[1]["held_bytes"] > ranks[0]["held_bytes"]
    assert ranks[0]["room"] == ranks[1]["room"] == 2**26 - ranks[1]["held_bytes"]
    # within the narrowest layout's: stacks of 4, 16 and 32, valid terms, used but never cached
    narrowest = ranks[0]["narrowest"]
    assert StepTerms.from_dict(narrowest).is_valid() and narrowest["extra"]["calibrate_widest"] == 32
    assert ranks[0]["cached_after_narrowest"] == []
    assert "stacks up to 32 wide, each freed" in done.log and "left room only for stacks up to 32 wide" in done.log
    for rank in ranks:  # within 1 KiB: refused on every rank, naming what it needs
        assert re.search(r"needs at least [0-9.]+ KiB \([0-9]+ bytes\) beside what the model holds, and the memory "
                         r"budget leaves 1.00 KiB: give a memory budget at least [0-9.]+ KiB larger",
                         rank["sixth_refused"]), rank["sixth_refused"]
    print(f"calibrate_s {first['calibrate_s']:.2f}; within {ranks[0]['least_room']} B: {fifth['calibrate_s']:.2f} s, "
          f"high-water +{ranks[0]['fifth_grown']} B")


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
    from osdp_lightning.cost.cluster import ClusterSpec
    from osdp_lightning.plan.plan import make_plan
    from osdp_lightning.profiling.records import ModelProfile, UnitProfile

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


def test_every_bench_runs_in_every_position_of_a_round() -> None:
    """The bench order rotates one place a round (reversing every other round kept the middle
    benches in the middle)."""
    names = ["local", "replicate", "zero2", "zero3", "local_split", "split(k=2, sharded=1)"]
    rounds = [rotated(names, index) for index in range(len(names))]
    assert all(sorted(order) == sorted(names) for order in rounds)
    for position in range(len(names)):
        assert sorted(order[position] for order in rounds) == sorted(names), position
    assert rotated(names, len(names)) == names and rotated([], 3) == []


@pytest.mark.parametrize("kind", ["replicate", "zero2", "zero3", "split"])
def test_bench_units_are_real_blocks_with_compute_between_their_collectives(kind: str) -> None:
    """Each family's bench units are what its fit is told they are (their bytes are the x-axis of
    the per-byte fits), and a block's norm and activation run between consecutive units' matmuls,
    on a micro-batch's rows, as in a real model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from osdp_lightning.calibrate.bench import (
        STACK_ROWS,
        STACK_WIDTHS,
        build_stack,
        stack_timings,
        stack_unit_names,
    )
    from osdp_lightning.choices import REGISTRY

    (family,) = [f for f in REGISTRY.families.values() if f.calibration is not None and f.kind == kind]
    calibration, width = family.calibration, STACK_WIDTHS[1]
    stack, root = build_stack(width, torch.device("cpu"))
    timings = stack_timings(calibration, dict.fromkeys(STACK_WIDTHS, 0.0), {})
    names = stack_unit_names(calibration)
    assert len(names) >= 2
    for name in names:
        params = list(stack.get_submodule(name).parameters())
        assert sum(p.numel() * 4 for p in params) == timings.unit_bytes[width] and len(params) == timings.unit_tensors
    assert set(timings.unit_bytes) == set(STACK_WIDTHS)

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple[str, tuple[int, ...]]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.ops.append((func.__name__, tuple(args[1].shape) if func.__name__.startswith("addmm") else ()))
            return func(*args, **(kwargs or {}))

    with Ops() as seen:
        root()
    matmuls = [i for i, (op, _) in enumerate(seen.ops) if op.startswith("addmm")]
    assert len(matmuls) == 2 * len(stack.blocks) and all(seen.ops[i][1] == (STACK_ROWS, width) for i in matmuls)
    for first, second in zip(matmuls, matmuls[1:], strict=False):  # a block's norm or activation between any two
        assert any(op.startswith(("gelu", "native_layer_norm")) for op, _ in seen.ops[first + 1:second])


def test_the_fit_leaves_what_the_model_lacks_given_the_stacks_compute() -> None:
    """The cost model's own price of a bench stack holds its measured compute and overlaps it with
    the collectives as plans do; a bench that took that plus a known machinery cost per group fits
    exactly that machinery."""
    from osdp_lightning.calibrate.bench import (
        STACK_WIDTHS,
        Bench,
        bench_specs,
        stack_unit_names,
        stack_unit_params,
    )
    from osdp_lightning.choices import REGISTRY

    zero3 = next(f.calibration for f in REGISTRY.families.values() if f.kind == "zero3" and f.calibration)
    collectives = {"all_gather": Affine(1e-4, 1e-9), "reduce_scatter": Affine(2e-4, 2e-9),
                   "all_reduce": Affine(2e-4, 2e-9)}
    idle = fitting._stack_model_s(collectives, zero3, 512, 2, (0.0, 0.0), 0.0)
    busy = fitting._stack_model_s(collectives, zero3, 512, 2, (0.01, 0.02), 0.0)
    hidden = fitting._stack_model_s(collectives, zero3, 512, 2, (0.01, 0.02), 1.0)
    assert busy == pytest.approx(idle + 0.03) and idle > 0
    assert busy - 0.03 > hidden - 0.03 > 0  # overlap hides the collectives, never their launches

    machinery = Affine(3e-3, 2e-9)
    # the collectives timed at three sizes exactly on their lines (the fit recovers them: 2 ranks move half)
    moved = {f"{kind}@{n}": line.seconds(1, n / 2) for kind, line in collectives.items() for n in (2**16, 2**20, 2**24)}
    benches: dict[tuple[str, int], Bench] = {}
    for spec in bench_specs(optional=True):
        for w in STACK_WIDTHS:
            forward_s, backward_s = 1e-5 * w, 2e-5 * w
            seconds = forward_s + backward_s
            if spec.calibration is not None and not spec.reference:
                units = len(stack_unit_names(spec.calibration))
                seconds = (fitting._stack_model_s(collectives, spec.calibration, w, 2, (forward_s, backward_s), 0.5)
                           + units * machinery.seconds(1, 4 * stack_unit_params(w, spec.calibration)))
            benches[spec.name, w] = Bench(None, None, [seconds], [1e-3], [forward_s])
    _, overhead, _ = fitting.fit_terms(moved, benches, 2, optional=True, overlap_efficiency=0.5)
    for kind in ("replicate", "zero2", "zero3"):
        assert overhead[kind].constant_s == pytest.approx(machinery.constant_s)
        assert overhead[kind].per_byte_s == pytest.approx(machinery.per_byte_s)


def test_one_process_prices_its_optimizer_step_and_its_loop() -> None:
    """One process calibrates no collectives and no sharding machinery, but it still times the
    optimizer step on plain tensors and adds the loop: a one-device plan's predicted step holds both
    (without them a one-GPU step is predicted 6-16% short)."""
    cpu = torch.device("cpu")
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    terms = measure_one_process_terms(cpu, adamw, loop_step_s=5e-3)
    assert terms.is_valid() and terms.loop_step_s == 5e-3 and "one process" in terms.source
    assert terms.optimizer_s(PLAIN, 2, 4 * 2**20) > 0 and terms.optimizer[PLAIN].per_byte_s > 0
    assert all(terms.optimizer[k] == terms.optimizer[PLAIN] for k in GROUP_TERMS)
    assert all(a == Affine(0.0, 0.0) for a in (*terms.collectives.values(), *terms.overhead.values()))
    without = measure_one_process_terms(cpu, None, loop_step_s=0.0)
    assert without.is_valid() and all(a == Affine(0.0, 0.0) for a in without.optimizer.values())

    trainer = L.Trainer(strategy=OSDPStrategy(), accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MLP(width=64))
    plan = trainer.strategy.plan
    assert "one process" in plan.step_terms_source
    assert plan.predicted_optimizer_s > 0 and plan.predicted_loop_s == 5e-3
    assert plan.predicted_step_s == pytest.approx(plan.predicted_compute_s + plan.predicted_optimizer_s
                                                  + plan.predicted_overhead_s + plan.predicted_exposed_comm_s
                                                  + plan.predicted_loop_s)


def test_calibration_takes_the_fastest_layout_of_its_benches_that_fits_its_room() -> None:
    """Every layout times every bench, each beside the one it is timed against; a room takes the
    fastest that fits it (all at once, a width at a time, a pair at a time, then narrower stacks and
    smaller collectives), and a room below the narrowest is refused naming what it needs."""
    from osdp_lightning.calibrate.bench import COLLECTIVE_BYTES, STACK_WIDTHS, bench_specs
    from osdp_lightning.calibrate.room import (
        CalibrationRoomError,
        calibration_layout,
        candidate_layouts,
        link_payload_bytes,
    )

    specs = bench_specs(optional=True)
    layouts = candidate_layouts(specs, 8, 2)
    for layout in layouts:
        widths = layout.widths
        assert {key for group in layout.groups for key in group} == {(s.name, w) for s in specs for w in widths}
        for group in layout.groups:
            names = {name for name, _ in group}
            assert all(s.against in names for s in specs if s.name in names and s.calibration and not s.reference)
        assert len(widths) == len(STACK_WIDTHS) and len(layout.collective_bytes) == len(COLLECTIVE_BYTES)
    assert [len(layout.groups) for layout in layouts[:3]] == [1, 3, 4 * 3]
    assert [layout.standard for layout in layouts] == [True] * 3 + [False] * (len(layouts) - 3)
    assert [layout.widths for layout in layouts[2:7]] == [(64, 256, 512), (32, 128, 256), (16, 64, 128),
                                                          (8, 32, 64), (4, 16, 32)]
    assert [max(layout.collective_bytes) for layout in layouts[2:]] == [2**24 >> h for h in range(len(layouts) - 2)]
    peaks = [layout.peak_bytes for layout in layouts]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    assert calibration_layout(specs, None, 8, 2) == layouts[0]
    for index, layout in enumerate(layouts):
        assert calibration_layout(specs, layout.peak_bytes, 8, 2) == layout
        if index + 1 < len(layouts):
            assert calibration_layout(specs, layout.peak_bytes - 1, 8, 2) == layouts[index + 1]
    least = layouts[-1].peak_bytes
    with pytest.raises(CalibrationRoomError, match=rf"needs at least {format_bytes(least)} \({least} bytes\).*"
                                                   rf"leaves {format_bytes(least - 10)}: .* at least 10 B larger"):
        calibration_layout(specs, least - 10, 8, 2)
    assert least < 2**19  # the narrowest stacks' pair beside 128 KiB collectives
    # the link probe every launch runs: its payload halved until it fits, refused below 64 KiB's
    assert link_payload_bytes(None, 2) == LINK_PAYLOAD_BYTES == link_payload_bytes(link_probe_bytes(2**23, 2), 2)
    assert link_payload_bytes(link_probe_bytes(2**23, 2) - 1, 2) == 2**22
    assert link_payload_bytes(link_probe_bytes(2**16, 2), 2) == 2**16
    with pytest.raises(CalibrationRoomError, match=r"timing the links needs at least .* at least 1 B larger"):
        link_payload_bytes(link_probe_bytes(2**16, 2) - 1, 2)
    # one process times only the plain stack (no collectives); SGD without momentum keeps no state
    alone = candidate_layouts(bench_specs(optional=False)[:1], 0, 1)
    assert alone[0].peak_bytes < layouts[0].peak_bytes and alone[-1].peak_bytes < least


def test_under_a_real_limit_calibration_holds_at_most_what_the_budget_leaves_beside_the_model(
        caplog: pytest.LogCaptureFixture) -> None:
    """Setup's room for calibration is a real limit less the model's bytes on the device (a model on
    meta holds none); a budget that bounds priced tensors leaves calibration unbounded. One process
    under a budget of a few MiB above its model calibrates on narrower stacks, says so, and trains."""
    from osdp_lightning.integration.config import OSDPConfig
    from osdp_lightning.integration.setup_core import OSDPSetup, Ranks

    model, budget = MLP(width=256), 12 * 2**20
    weights = sum(p.numel() * 4 for p in model.parameters())

    def room(module: torch.nn.Module, **config: object) -> int | None:
        return OSDPSetup(OSDPConfig(**config), Ranks(torch.device("cpu"), 1, 1, 1, 0)).calibration_room_bytes(module)

    assert room(model, memory_budget=budget) == budget - weights
    with torch.device("meta"):
        assert room(MLP(width=256), memory_budget=budget) == budget
    for tensors_only in ({"memory_budget": "70%ddp"}, {"memory_budget": budget, "budget_covers": "tensors"},
                         {"memory_budget": budget, "headroom": "1MiB"}):
        assert room(model, **tensors_only) is None, tensors_only

    trainer = L.Trainer(strategy=OSDPStrategy(memory_budget=budget), accelerator="cpu", devices=1, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level("INFO"):
        trainer.fit(model)
    assert f"osdp: calibrating within {format_bytes(budget - weights)} (the memory budget less the model's bytes): " \
           "its benches in 3 groups, stacks up to 256 wide" in caplog.text
    assert trainer.strategy.plan.predicted_optimizer_s > 0
    # with no room at all one process leaves its optimizer step unpriced: its plan does not depend on it
    caplog.clear()
    with caplog.at_level("INFO"):
        terms = measure_one_process_terms(torch.device("cpu"), torch.optim.AdamW(model.parameters()),
                                          loop_step_s=0.0, room_bytes=0)
    assert terms.optimizer[PLAIN] == Affine(0.0, 0.0) and terms.is_valid()
    assert "osdp: the optimizer step is not timed: calibrating the step terms needs at least" in caplog.text
