"""Group sharding choices in the cost model and in apply: ``hsdp(g=G)`` and ``zero3(reshard=G)``."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from osdp_lightning.choices import ChoiceOptions, choice_cost, choice_space, hsdp_choice, is_known, parse
from osdp_lightning.choices import zero3_reshard_choice as zero3_reshard
from osdp_lightning.choices.groups import hsdp_kwargs, zero3_reshard_kwargs
from osdp_lightning.cost.cluster import ClusterSpec
from osdp_lightning.cost.cost import CostContext, all_gather_s, all_reduce_s
from osdp_lightning.plan.choice_table import build_choice_table
from osdp_lightning.plan.plan import make_plan
from osdp_lightning.profiling.records import ModelProfile, UnitProfile
from osdp_lightning.runtime.meshes import Meshes

P = 1_000_000
UNIT = UnitProfile(name="block", module_names=("block",), param_count=P, frozen_param_count=0,
                   forward_s=0.01, backward_s=0.02, activation_bytes=0)
PROFILE = ModelProfile(units=(UNIT, UnitProfile("", ("",), 0, 0, 0.0, 0.0, 0)), micro_batch_size=4,
                       param_bytes_per_element=4, grad_bytes_per_element=4, compute_bytes_per_element=4,
                       reduce_bytes_per_element=4, optimizer_bytes_per_param=8, activation_bytes=10**6)
TWO_NODES = ClusterSpec(world_size=16, memory_budget_bytes=2**34, collective_latency_s=1e-5,
                        bandwidth_bytes_per_s=1e11, ranks_per_node=8, inter_node_bandwidth_bytes_per_s=1e10,
                        inter_node_latency_s=1e-4)


def cost_of(choice: str, cluster: ClusterSpec = TWO_NODES):  # noqa: ANN201
    return choice_cost(UNIT, choice, CostContext(PROFILE, cluster))


def group_choices(cluster: ClusterSpec, sizes: tuple[int, ...] | None = None) -> list[str]:
    space = choice_space(cluster, ChoiceOptions(group_sizes=sizes, activation_checkpointing="never"))
    return [str(c) for c in space if c.kind == "hsdp" or c.params]


def test_choice_names_round_trip_and_stay_apart() -> None:
    assert str(hsdp_choice(8)) == "hsdp(g=8)" and parse("hsdp(g=8)")["g"] == 8
    assert str(zero3_reshard(4)) == "zero3(reshard=4)" and parse("zero3(reshard=4)")["reshard"] == 4
    for name in ("hsdp(g=8)", "zero3(reshard=4)"):
        assert is_known(name) and parse(name).kind != "split" and str(parse(name)) == name
    assert parse("zero3(reshard=4)") != parse("zero3") and parse("zero3(reshard=4)").kind == "zero3"
    assert not is_known("hsdp(8)") and not is_known("zero3(reshard=)") and not is_known("hsdp(k=8)")


def test_group_choices_default_to_one_node_and_only_on_several_nodes() -> None:
    assert group_choices(TWO_NODES) == ["hsdp(g=8)", "zero3(reshard=8)"]
    one_node = ClusterSpec(world_size=8, memory_budget_bytes=1, collective_latency_s=0, bandwidth_bytes_per_s=1)
    assert group_choices(one_node) == []
    assert group_choices(TWO_NODES, (2, 3, 16, 1)) == ["hsdp(g=2)", "zero3(reshard=2)"]


def test_hsdp_shards_in_the_node_and_all_reduces_across_nodes() -> None:
    cost = cost_of("hsdp(g=8)")
    assert cost.state_bytes == P * (4 + 4 + 8) // 8
    assert (cost.held_bytes, cost.transient_bytes, cost.prefetch) == (0, P * 8, P * 4)
    in_node = 2 * all_gather_s(4 * P, 8, TWO_NODES) + all_gather_s(4 * P, 8, TWO_NODES)
    across = all_reduce_s(4 * P / 8, 2, TWO_NODES, crosses_nodes=True)
    assert cost.comm_s == pytest.approx(in_node + across)
    assert TWO_NODES.link(False)[1] == 1e11  # the in-group collectives used the fast link
    assert in_node == pytest.approx(3 * (1e-5 + 4 * P * 7 / 8 / 1e11))
    assert across == pytest.approx(1e-4 + 2 * (4 * P / 8) / 2 / 1e10)
    assert cost.exposed_s == pytest.approx(3 * 1e-5 + 1e-4)  # latencies no compute can hide


def test_zero3_and_replicate_across_nodes_pay_the_inter_node_link() -> None:
    zero3 = cost_of("zero3")
    assert zero3.comm_s == pytest.approx(3 * (1e-4 + 4 * P * 15 / 16 / 1e10))
    replicate = cost_of("replicate")
    assert replicate.comm_s == pytest.approx(1e-4 + 2 * 4 * P * 15 / 16 / 1e10)
    assert cost_of("hsdp(g=8)").comm_s < zero3.comm_s


def test_zero3_reshard_keeps_the_backward_all_gather_in_the_node() -> None:
    cost = cost_of("zero3(reshard=8)")
    zero3 = cost_of("zero3")
    assert cost.state_bytes == zero3.state_bytes and cost.held_bytes == P * 4 // 8
    expected = (all_gather_s(4 * P, 16, TWO_NODES) + all_gather_s(4 * P, 8, TWO_NODES)
                + all_gather_s(4 * P, 16, TWO_NODES))
    assert cost.comm_s == pytest.approx(expected)
    assert cost.comm_s < zero3.comm_s
    assert cost.exposed_s == pytest.approx(2 * 1e-4 + 1e-5) and zero3.exposed_s == pytest.approx(3 * 1e-4)


@pytest.mark.parametrize("group", [1, 3, 16])
def test_bad_group_sizes_are_refused(group: int) -> None:
    with pytest.raises(ValueError, match="group size"):
        cost_of(f"hsdp(g={group})")


def test_plans_can_choose_group_sharding_when_memory_is_tight() -> None:
    choices = ("replicate", "zero3", *group_choices(TWO_NODES))
    table = build_choice_table(PROFILE, TWO_NODES, choices=choices)
    assert [c.choice for c in table.units[0].choices] == list(choices)
    replicate_peak = make_plan(PROFILE, TWO_NODES, uniform_choice="replicate", choices=choices).predicted_peak_bytes
    hsdp = make_plan(PROFILE, TWO_NODES, uniform_choice="hsdp(g=8)", choices=choices)
    assert hsdp.predicted_peak_bytes < replicate_peak
    tight = dataclasses.replace(TWO_NODES, memory_budget_bytes=hsdp.predicted_peak_bytes)
    solved = make_plan(PROFILE, tight, choices=choices)
    # With inter-node bandwidth 10x slower, group sharding beats zero3 wherever it fits.
    assert solved.choice_of("block") in ("hsdp(g=8)", "zero3(reshard=8)")


def test_shard_kwargs_of_group_choices() -> None:
    shard, replicate, group_mesh = object(), object(), object()
    meshes = Meshes(shard=shard, replicate=replicate, groups={8: group_mesh})  # type: ignore[arg-type]
    assert hsdp_kwargs(parse("hsdp(g=8)"), meshes) == {"mesh": group_mesh, "reshard_after_forward": True}
    assert zero3_reshard_kwargs(parse("zero3(reshard=8)"), meshes) == {"mesh": shard, "reshard_after_forward": 8}
    no_groups = Meshes(shard=SimpleNamespace(size=lambda: 16), replicate=replicate)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"needs a \(2, 8\) mesh"):
        hsdp_kwargs(parse("hsdp(g=8)"), no_groups)
