"""ClusterSpec construction: from the cluster configs, from the live topology, and how a group that
spans nodes is charged the inter-node link."""

from __future__ import annotations

import pytest

from osdp_lightning.calibrate import CollectiveTimings
from osdp_lightning.cost.cluster import (
    ClusterSpec,
    NodeTimings,
    cluster_config_dir,
    cluster_spec_from_config,
    describe_cluster,
    environment_topology,
    live_cluster_spec,
    load_cluster_config,
    load_cluster_spec,
)
from osdp_lightning.cost.cost import all_gather_s, all_reduce_s

CONFIG_NAMES = sorted(p.stem for p in cluster_config_dir().glob("*.yaml"))


def test_the_cluster_configs_are_found() -> None:
    assert {"a100_80g_x8", "h100_80g_x8x2", "titan_rtx_24g_x8", "cpu_2"} <= set(CONFIG_NAMES)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_cluster_config_builds_a_spec(name: str) -> None:
    config = load_cluster_config(name)
    spec = load_cluster_spec(name)
    assert spec.world_size == config["devices_per_node"] * config["nodes"]
    assert spec.local_world_size == config["devices_per_node"] and spec.num_nodes == config["nodes"]
    assert spec.memory_budget_bytes > 0 and spec.bandwidth_bytes_per_s > 0
    assert spec.peak_flops_per_s and spec.peak_flops_per_s > 0
    assert f"{spec.num_nodes} node(s) x {spec.local_world_size} ranks" in describe_cluster(spec)


def test_two_node_config_keeps_both_links() -> None:
    spec = load_cluster_spec("h100_80g_x8x2")
    assert (spec.world_size, spec.local_world_size, spec.num_nodes) == (16, 8, 2)
    assert spec.link(crosses_nodes=False) == (2.0e-5, 3.6e11)
    assert spec.link(crosses_nodes=True) == (5.0e-5, 4.5e10)
    assert spec.memory_budget_bytes == 80 * 2**30 and spec.headroom_bytes == 2 * 2**30
    assert "inter-node 45 GB/s" in describe_cluster(spec)


def test_budget_override_and_missing_keys() -> None:
    config = load_cluster_config("a100_80g_x8")
    assert cluster_spec_from_config(config, memory_budget="8GiB").memory_budget_bytes == 8 * 2**30
    with pytest.raises(ValueError, match="lacks"):
        cluster_spec_from_config({"name": "broken", "devices_per_node": 8})
    with pytest.raises(FileNotFoundError, match="known"):
        load_cluster_config("no_such_cluster")


def test_a_group_spanning_nodes_pays_the_inter_node_link() -> None:
    spec = ClusterSpec(world_size=16, memory_budget_bytes=2**30, collective_latency_s=1e-5,
                       bandwidth_bytes_per_s=1e11, ranks_per_node=8, inter_node_bandwidth_bytes_per_s=1e10,
                       inter_node_latency_s=1e-4)
    nbytes = 8e8
    assert all_gather_s(nbytes, 8, spec) == pytest.approx(1e-5 + nbytes * 7 / 8 / 1e11)
    assert all_gather_s(nbytes, 16, spec) == pytest.approx(1e-4 + nbytes * 15 / 16 / 1e10)
    assert all_reduce_s(nbytes, 2, spec, crosses_nodes=True) == pytest.approx(1e-4 + nbytes / 1e10)
    single = ClusterSpec(world_size=8, memory_budget_bytes=2**30, collective_latency_s=1e-5,
                         bandwidth_bytes_per_s=1e11)
    assert not single.crosses_nodes(8) and single.num_nodes == 1


def test_live_spec_splits_intra_and_inter_node_timings() -> None:
    world = CollectiveTimings(latency_s=3e-4, bandwidth_bytes_per_s=2e8, overlap_efficiency=0.1, calibrate_s=1.0)
    nodes = NodeTimings(intra_latency_s=1e-4, intra_bandwidth_bytes_per_s=1e9, inter_latency_s=5e-4,
                        inter_bandwidth_bytes_per_s=1e8, measure_s=0.5)
    spec = live_cluster_spec(world_size=4, ranks_per_node=2, memory_budget_bytes=2**30, timings=world,
                             node_timings=nodes, headroom_bytes=7)
    assert (spec.num_nodes, spec.local_world_size) == (2, 2)
    assert spec.link(False) == (1e-4, 1e9) and spec.link(True) == (5e-4, 1e8)
    assert spec.overlap_efficiency == 0.1 and spec.headroom_bytes == 7
    one_node = live_cluster_spec(world_size=2, ranks_per_node=2, memory_budget_bytes=2**30, timings=world)
    assert one_node.link(False) == (3e-4, 2e8) and one_node.num_nodes == 1
    alone = live_cluster_spec(world_size=1, ranks_per_node=1, memory_budget_bytes=2**30, timings=None)
    assert alone.collective_latency_s == 0.0


def test_environment_topology_reads_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert environment_topology() == (16, 8)
