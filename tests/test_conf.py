"""Every config composes and instantiates: every option of every group (in-process, fast).

Models of planning size are built on the meta device, so bert_large or gpt_xl allocate nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import DictConfig

import osdp_lightning
from osdp_lightning.cli.common import cluster_spec

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose_train(*overrides: str, config_name: str = "train") -> DictConfig:
    with initialize_config_module("osdp_lightning.conf", version_base="1.3"):
        return compose(config_name, overrides=["output_dir=/tmp/unused", *overrides])


REQUIRED_MODELS = ["gpt_tiny", "gpt_small", "gpt_medium", "gpt_large", "gpt_xl", "gpt_48l_h1536", "bert_tiny",
                   "bert_base", "bert_large", "t5_tiny", "t5_small", "t5_base", "t5_large"]
REQUIRED_CLUSTERS = ["cpu_2", "titan_rtx_24g_x8", "v100_16g_x8", "a100_40g_x8", "a100_80g_x8", "h100_80g_x8x2"]
# Parameter counts of the published shapes (GPT-2 with its vocabulary padded to 50304; BERT
# without the pooler and segment embeddings; T5 v1.0 with the tied head).
EXPECTED_PARAMS_M = {"gpt_small": 124.5, "gpt_medium": 354.9, "gpt_large": 774.1, "gpt_xl": 1557.7,
                     "gpt_48l_h1536": 1438.8, "bert_base": 109.5, "bert_large": 335.2, "t5_small": 60.5,
                     "t5_base": 222.9, "t5_large": 737.7}


def test_required_options_exist() -> None:
    assert set(REQUIRED_MODELS) <= set(options("model"))
    assert set(REQUIRED_CLUSTERS) <= set(options("cluster"))
    assert {"osdp", "ddp", "zero2", "zero3"} <= set(options("strategy"))


@pytest.mark.parametrize("model", options("model"))
def test_model_composes_and_instantiates_on_meta(model: str) -> None:
    cfg = compose_train(f"model={model}")
    with torch.device("meta"):
        module = instantiate(cfg.model)
    datamodule = instantiate(cfg.data)
    params = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    if model.endswith("_tiny"):
        assert params < 1_000_000
    if model in EXPECTED_PARAMS_M:
        assert abs(params / 1e6 - EXPECTED_PARAMS_M[model]) < 0.1, params
    assert module.net.config.vocab_size >= datamodule.vocab_size
    assert datamodule.tokens_per_sample > 0


@pytest.mark.parametrize("cluster", options("cluster"))
def test_cluster_composes_and_builds_a_cluster_spec(cluster: str) -> None:
    cfg = compose_train(f"cluster={cluster}")
    spec = cluster_spec(cfg.cluster)
    assert cfg.cluster.name == cluster
    assert spec.world_size == cfg.cluster.devices_per_node * cfg.cluster.nodes
    assert spec.memory_budget_bytes == osdp_lightning.parse_bytes(cfg.cluster.memory_per_device)
    assert cfg.trainer.devices == cfg.cluster.devices_per_node and cfg.trainer.num_nodes == cfg.cluster.nodes
    if cluster == "h100_80g_x8x2":
        assert spec.world_size == 16 and cfg.cluster.nodes == 2


def test_memory_budget_override_reaches_strategy_and_planner() -> None:
    cfg = compose_train("cluster.memory_budget=384MiB")
    assert cluster_spec(cfg.cluster).memory_budget_bytes == 384 * 2**20
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert strategy.memory_budget_bytes == 384 * 2**20


@pytest.mark.parametrize("strategy", options("strategy"))
def test_strategy_instantiates(strategy: str) -> None:
    cfg = compose_train(f"strategy={strategy}")
    instance = instantiate(cfg.strategy, _convert_="all")
    assert isinstance(instance, osdp_lightning.OSDPStrategy)
    expected = {"osdp": None, "ddp": "replicate", "zero2": "zero2", "zero3": "zero3"}.get(strategy)
    assert instance.uniform_choice == expected


@pytest.mark.parametrize("data,model", [("gpt_text", "gpt_tiny"), ("bert_text", "bert_tiny"),
                                        ("t5_span", "t5_small"), ("t5_tasks", "t5_tiny")])
def test_every_data_option_instantiates(data: str, model: str) -> None:
    assert data in options("data")
    cfg = compose_train(f"model={model}", f"data={data}")
    datamodule = instantiate(cfg.data)
    assert datamodule.batch_size == cfg.data.batch_size


def test_all_data_options_are_covered() -> None:
    assert options("data") == ["bert_text", "gpt_text", "t5_span", "t5_tasks"]


@pytest.mark.parametrize("trainer", options("trainer"))
def test_trainer_instantiates_with_osdp_on_cpu_2(trainer: str, tmp_path: Path) -> None:
    cfg = compose_train(f"trainer={trainer}", f"output_dir={tmp_path}")
    instance = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy, _convert_="all"), logger=False)
    assert instance.num_devices == 2 and instance.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize("logger", options("logger"))
def test_logger_instantiates(logger: str, tmp_path: Path) -> None:
    cfg = compose_train(f"logger={logger}", f"output_dir={tmp_path}")
    for entry in cfg.logger.values():
        assert Path(instantiate(entry).log_dir) == tmp_path / "csv"


@pytest.mark.parametrize("experiment", options("experiment"))
@pytest.mark.parametrize("config_name", ["train", "plan"])
def test_experiment_composes(experiment: str, config_name: str) -> None:
    cfg = compose_train(f"experiment={experiment}", config_name=config_name)
    with torch.device("meta"):
        instantiate(cfg.model)
    cluster_spec(cfg.cluster)


def test_plan_config_defaults_to_gpt_small_on_cpu_2() -> None:
    cfg = compose_train(config_name="plan")
    assert cfg.model.net.config.n_layer == 12 and cfg.cluster.name == "cpu_2"
    assert "trainer" not in cfg
