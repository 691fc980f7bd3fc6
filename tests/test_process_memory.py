"""What a rank's process holds beside its tensors: the figures, and the bytes plans keep free for it."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.reprice_memory import profile_from_dict
from osdp_lightning.choices import BASE_CHOICES
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.plan.choice_table import build_choice_table
from osdp_lightning.runtime import process_memory
from osdp_lightning.runtime.process_memory import (
    CUDA_ALLOC_CONF,
    EXPANDABLE_SEGMENTS,
    anonymous_bytes,
    fixed_cost_bytes,
    module_tensor_bytes,
    prefer_expandable_segments,
    resident_bytes,
    tensor_bytes,
    untracked_growth_bytes,
)
from osdp_lightning.solve import peak_bytes, solve_choice_table

MIB = 2**20
RECORDED = Path(__file__).parent / "fixtures" / "recorded_profiles.json"


def test_tensor_bytes_counts_each_storage_once_and_nothing_on_meta() -> None:
    whole = torch.zeros(MIB // 4)  # 1 MiB of float32
    views = [whole, whole[:10], whole.view(2, -1)]
    assert tensor_bytes(views) == MIB
    assert tensor_bytes([torch.zeros(8, device="meta"), None]) == 0
    assert tensor_bytes([whole, torch.zeros(256)]) == MIB + 1024


def test_module_tensor_bytes_counts_parameters_gradients_buffers_and_optimizer_state() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256))
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert module_tensor_bytes(model) == params + buffers
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    # gradients, and Adam's two moments per parameter
    assert module_tensor_bytes(model, [optimizer]) == 4 * params + buffers + steps


def test_the_process_figures_come_from_proc() -> None:
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc here: the figures are 0 and nothing is kept free")
    resident, before = resident_bytes(), anonymous_bytes()
    assert 0 < before < resident
    block = torch.ones(64 * MIB // 4)  # written: 64 MiB more of the process's own memory
    after = anonymous_bytes()
    assert after - before >= 60 * MIB
    assert untracked_growth_bytes(before, after, 0, 64 * MIB) <= 4 * MIB  # the tensor itself is tracked
    model = nn.Linear(2048, 2048)  # 16 MiB of weights: the fixed cost leaves them out
    assert fixed_cost_bytes(model) <= resident_bytes() - 16 * MIB
    del block


def test_untracked_growth_is_what_grew_beyond_the_tensors_left_alive() -> None:
    assert untracked_growth_bytes(100 * MIB, 150 * MIB, 10 * MIB, 40 * MIB) == 20 * MIB
    assert untracked_growth_bytes(100 * MIB, 90 * MIB, 10 * MIB, 10 * MIB) == 0  # never negative
    assert untracked_growth_bytes(0, 150 * MIB) == 0  # not measured: no /proc


def test_plans_keep_the_untracked_bytes_free_beside_the_headroom() -> None:
    spec = ClusterSpec(world_size=2, memory_budget_bytes=480 * MIB, collective_latency_s=1e-4,
                       bandwidth_bytes_per_s=1e9, headroom_fraction=0.025, untracked_bytes=16 * MIB)
    assert spec.usable_bytes == 480 * MIB - 12 * MIB - 24 * MIB  # measured 16 MiB, and half again
    assert spec.kept_free_bytes(400 * MIB) == 10 * MIB + 24 * MIB
    # a budget named in bytes leaves room for a later launch measuring half again (24 MiB); exact there
    assert spec.named_untracked_bytes == 24 * MIB
    smallest = spec.smallest_budget_for(440 * MIB)
    assert smallest - spec.headroom_for(smallest) - 24 * MIB >= 440 * MIB
    assert (smallest - 1) - spec.headroom_for(smallest - 1) - 24 * MIB < 440 * MIB
    with pytest.raises(ValueError, match="untracked"):
        ClusterSpec(world_size=2, memory_budget_bytes=MIB, collective_latency_s=0.0, bandwidth_bytes_per_s=1.0,
                    untracked_bytes=-1)



def test_a_real_limit_prices_ddps_bucket_rebuild() -> None:
    """Once, at the second step's forward, DDP's reducer allocates its buckets again before it frees
    the first ones: where the budget counts that moment, the all-replicate plan of a recorded GPT
    (27.7 MiB of gradients, 12 MiB of activations) peaks there, at the whole state plus the
    replicated gradients again; solved at its step's peak, the plan replicates less."""
    record = json.loads(RECORDED.read_text())["profiles"]["gpt_4x384_w2"]
    profile = profile_from_dict(record["profile"])
    step_only = ClusterSpec(memory_budget_bytes=2**40, **record["links"])
    counted = dataclasses.replace(step_only, bucket_rebuild_counted=True)
    plain, rebuilt = (build_choice_table(profile, c, choices=BASE_CHOICES) for c in (step_only, counted))
    replicate = ["replicate"] * len(plain.units)
    grads = sum(u.param_count for u in profile.units) * profile.grad_bytes_per_element
    assert sum(unit.cost_of("replicate").rebuild_bytes for unit in rebuilt.units) == grads
    assert all(c.rebuild_bytes == 0 for unit in rebuilt.units for c in unit.choices if c.choice != "replicate")
    state = sum(unit.cost_of("replicate").state_bytes for unit in plain.units)
    assert peak_bytes(rebuilt, replicate) == state + grads + plain.fixed_bytes > peak_bytes(plain, replicate)
    budget = peak_bytes(plain, replicate)
    solution = solve_choice_table(rebuilt, budget)
    assert "zero" in " ".join(solution.choices) and peak_bytes(rebuilt, solution.choices) <= budget
    assert solve_choice_table(plain, budget).choices == tuple(replicate)


def test_expandable_segments_are_set_only_where_the_user_set_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CUDA_ALLOC_CONF, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert prefer_expandable_segments() and os.environ[CUDA_ALLOC_CONF] == EXPANDABLE_SEGMENTS
    monkeypatch.setenv(CUDA_ALLOC_CONF, "max_split_size_mb:128")
    assert not prefer_expandable_segments() and os.environ[CUDA_ALLOC_CONF] == "max_split_size_mb:128"
    monkeypatch.delenv(CUDA_ALLOC_CONF)
    monkeypatch.setattr(process_memory.torch.cuda, "is_initialized", lambda: True)  # too late: left alone
    assert not prefer_expandable_segments() and CUDA_ALLOC_CONF not in os.environ


def test_what_a_budget_covers_is_checked_where_it_is_written() -> None:
    from osdp_lightning.integration.config import OSDPConfig

    assert OSDPConfig().budget_covers == "process"
    assert OSDPConfig(budget_covers="tensors").budget_covers == "tensors"
    with pytest.raises(ValueError, match="budget_covers='everything'.*'process'.*'tensors'"):
        OSDPConfig(budget_covers="everything")


def test_code_pages_at_peak_counts_the_file_pages_resident_before_the_high_water_last_rose(monkeypatch) -> None:
    statuses = iter([{"VmHWM": 500, "RssFile": 110}, {"VmHWM": 500, "RssFile": 120},
                     {"VmHWM": 700, "RssFile": 125}, {"VmHWM": 700, "RssFile": 140}])
    monkeypatch.setattr(process_memory, "process_status_bytes", lambda *fields: next(statuses))
    pages = process_memory.CodePagesAtPeak(100)
    pages.sample()  # the high-water rose after the fixed cost's measurement: only its pages are sure
    assert pages.loaded_before_peak_bytes == 0
    pages.sample()
    pages.sample()  # it rose again after the sample that read 120
    assert pages.loaded_before_peak_bytes == 20
    pages.sample()  # pages loaded after the peak are not counted
    assert pages.loaded_before_peak_bytes == 20


def test_code_pages_at_peak_reads_this_process() -> None:
    pages = process_memory.CodePagesAtPeak(process_memory.file_bytes())
    pages.sample()
    assert pages.loaded_before_peak_bytes == 0
    assert process_memory.file_bytes() > 0
