"""Checkpoint format, atomicity and refusal of incomplete checkpoints (in-process, one rank, fast).

The same code runs on every rank of a real run; tests/test_resume.py covers 2-rank runs.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import lightning
import pytest
import torch
from torch import nn

from osdp_lightning import OSDPStrategy
from osdp_lightning.runtime.faults import RankFailedError, all_ranks_succeed, raise_if_any_rank_failed
from osdp_lightning.runtime.split import split_linear_in_module
from osdp_lightning.state import checkpoint as ckpt
from osdp_lightning.state.canonical import split_optimizer_state

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from toy_models import MLP  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def trained(split: bool, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP(width=16)
    if split:
        split_linear_in_module(model, "net.2", 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model.net(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, sharded: bool = True, step: int = 2) -> None:
    checkpoint = {"state_dict": ckpt.model_state(model, full=not sharded),
                  "optimizer_states": [ckpt.optimizer_state(model, optimizer, full=not sharded)],
                  "global_step": step, "epoch": 0, "pytorch-lightning_version": lightning.__version__}
    ckpt.save_checkpoint(checkpoint, path, sharded=sharded, info={"plan": None})


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_same_state(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif key != "params":
            assert a[key] == b[key], key


def test_split_layers_are_canonical_in_model_and_optimizer_state() -> None:
    split_model, split_opt = trained(split=True)
    plain_model, plain_opt = trained(split=False)
    model_state = ckpt.model_state(split_model, full=False)
    assert {k: v.shape for k, v in model_state.items()} == {k: v.shape for k, v in plain_model.state_dict().items()}
    canonical = ckpt.optimizer_state(split_model, split_opt, full=False)
    reference = ckpt.optimizer_state(plain_model, plain_opt, full=False)
    assert canonical["param_groups"][0]["params"] == reference["param_groups"][0]["params"]  # weight, then bias
    assert canonical["state"].keys() == reference["state"].keys()
    assert canonical["state"]["net.2.weight"]["exp_avg"].shape == (16, 16)
    # the split and the plain layer compute the same function; their Adam moments agree closely
    torch.testing.assert_close(canonical["state"]["net.2.weight"]["exp_avg"],
                               reference["state"]["net.2.weight"]["exp_avg"], atol=1e-6, rtol=1e-5)
    raw = torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(split_model, split_opt)
    back = split_optimizer_state(split_model, canonical, raw)
    assert_same_state(back["state"], raw["state"])


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "consolidated"])
@pytest.mark.parametrize("source_split, target_split", [(True, False), (False, True)])
def test_checkpoint_loads_into_another_layout(tmp_path: Path, sharded: bool, source_split: bool,
                                              target_split: bool) -> None:
    model, optimizer = trained(split=source_split)
    save(model, optimizer, tmp_path / "a.ckpt", sharded=sharded)
    assert ckpt.check_checkpoint(tmp_path / "a.ckpt") == ("sharded" if sharded else "consolidated")
    target, target_opt = trained(split=target_split, steps=0)
    rest = ckpt.load_checkpoint(tmp_path / "a.ckpt", target, [target_opt], strict=True)
    assert rest["global_step"] == 2 and "state_dict" not in rest and "optimizer_states" not in rest
    assert_same_state(ckpt.model_state(target, full=False), ckpt.model_state(model, full=False))
    assert_same_state(ckpt.optimizer_state(target, target_opt, full=False),
                      ckpt.optimizer_state(model, optimizer, full=False))


def test_strict_loading_names_what_differs(tmp_path: Path) -> None:
    model, optimizer = trained(split=False)
    save(model, optimizer, tmp_path / "a.ckpt", sharded=False)
    bigger = MLP(width=16, depth=5)
    with pytest.raises(KeyError, match="missing .*net.10"):
        ckpt.load_checkpoint(tmp_path / "a.ckpt", bigger, [], strict=True)


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = trained(split=False)
    target = tmp_path / "last.ckpt"
    save(model, optimizer, target, step=2)
    real_write = ckpt._write_durably

    def die_on_meta(path: Path, write) -> None:  # noqa: ANN001
        if path.name == ckpt.META_NAME:
            raise OSError("disk full (simulated)")
        real_write(path, write)

    monkeypatch.setattr(ckpt, "_write_durably", die_on_meta)
    with pytest.raises(OSError, match="disk full"):
        save(model, optimizer, target, step=4)
    assert ckpt.check_checkpoint(target) == "sharded" and ckpt._global_step(target) == 2
    (partial,) = tmp_path.glob(".last.ckpt.osdp-partial-*")
    with pytest.raises(ckpt.IncompleteCheckpointError, match="unfinished save.*last complete checkpoint"):
        ckpt.check_checkpoint(partial)
    monkeypatch.setattr(ckpt, "_write_durably", real_write)
    save(model, optimizer, target, step=6)
    assert ckpt._global_step(target) == 6 and not list(tmp_path.glob(".last.ckpt.osdp-*"))


def test_incomplete_checkpoints_are_refused_with_what_is_wrong(tmp_path: Path) -> None:
    model, optimizer = trained(split=False)
    good = tmp_path / "step=2.ckpt"
    save(model, optimizer, good)
    for damage, pattern in [("meta", "meta.pt is missing"), ("shard", "shard __0_0.distcp is missing or truncated"),
                            ("dcp", r"\.metadata is missing")]:
        broken = tmp_path / f"broken-{damage}.ckpt"
        shutil.copytree(good, broken)
        if damage == "meta":
            (broken / ckpt.META_NAME).unlink()
        elif damage == "shard":
            shard = broken / "__0_0.distcp"
            shard.write_bytes(shard.read_bytes()[:100])
        else:
            (broken / ckpt.DCP_METADATA_NAME).unlink()
        with pytest.raises(ckpt.IncompleteCheckpointError, match=pattern):
            ckpt.load_checkpoint(broken, copy.deepcopy(model), [], strict=True)
    single = tmp_path / "single.ckpt"
    save(model, optimizer, single, sharded=False)
    single.write_bytes(single.read_bytes()[:-200])
    with pytest.raises(ckpt.IncompleteCheckpointError, match="truncated or damaged"):
        ckpt.check_checkpoint(single)
    assert ckpt.find_latest_checkpoint(tmp_path) == good


def test_a_save_interrupted_between_renames_points_at_the_old_copy(tmp_path: Path) -> None:
    model, optimizer = trained(split=False)
    save(model, optimizer, tmp_path / "last.ckpt")
    (tmp_path / "last.ckpt").rename(tmp_path / ".last.ckpt.osdp-old-123")
    with pytest.raises(ckpt.IncompleteCheckpointError, match="previous version is intact at .*osdp-old-123"):
        ckpt.check_checkpoint(tmp_path / "last.ckpt")
    with pytest.raises(FileNotFoundError):
        ckpt.check_checkpoint(tmp_path / "other.ckpt")


def test_checkpoints_load_without_osdp_or_a_process_group(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model, optimizer = trained(split=True)
    save(model, optimizer, tmp_path / "a.ckpt")
    expected = ckpt.model_state(model, full=True)
    plain = MLP(width=16)
    plain.load_state_dict(ckpt.load_model_weights(tmp_path / "a.ckpt"))
    assert_same_state(plain.state_dict(), expected)
    dcp_to_torch_save(tmp_path / "a.ckpt", tmp_path / "full.pt")  # the documented plain-torch way
    assert_same_state(torch.load(tmp_path / "full.pt")["state_dict"], expected)
    out = ckpt.consolidate_checkpoint(tmp_path / "a.ckpt", tmp_path / "one.ckpt")
    assert_same_state(MLP.load_from_checkpoint(out, width=16).state_dict(), expected)


def test_meta_file_loads_with_weights_only(tmp_path: Path) -> None:
    model, optimizer = trained(split=False)
    save(model, optimizer, tmp_path / "a.ckpt")
    meta = torch.load(tmp_path / "a.ckpt" / ckpt.META_NAME, weights_only=True)  # RNG states included
    assert len(meta["osdp"]["rng_states"]) == 1


def test_save_refuses_storage_options() -> None:
    with pytest.raises(TypeError, match="storage_options"):
        OSDPStrategy().save_checkpoint({}, "x.ckpt", storage_options={"s3": True})


def test_fail_fast_helpers_in_one_process() -> None:
    raise_if_any_rank_failed(None, "nothing")
    with pytest.raises(ValueError, match="boom"):
        with all_ranks_succeed("testing"):
            raise ValueError("boom")
    assert issubclass(RankFailedError, RuntimeError)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "consolidated"])
def test_saving_before_the_first_step_changes_nothing(tmp_path: Path, sharded: bool) -> None:
    # get_optimizer_state_dict gives a fresh Adam a zero step (step count 1); that must not stick
    model, optimizer = trained(split=True, steps=0)
    save(model, optimizer, tmp_path / "a.ckpt", sharded=sharded, step=0)
    assert not optimizer.state
    target, target_opt = trained(split=False, steps=0)
    ckpt.load_checkpoint(tmp_path / "a.ckpt", target, [target_opt], strict=True)
    assert not target_opt.state  # the resumed run takes its first step like the uninterrupted one


def test_a_plain_optimizer_state_keyed_by_position_loads_into_a_split_model() -> None:
    # e.g. a consolidated checkpoint of a strategy="ddp" run, resumed under osdp
    model, optimizer = trained(split=False)
    target, target_opt = trained(split=True, steps=0)
    ckpt.load_full_model_state(target, model.state_dict())
    ckpt.load_full_optimizer_state(target, target_opt, optimizer.state_dict())
    assert_same_state(ckpt.optimizer_state(target, target_opt, full=False),
                      ckpt.optimizer_state(model, optimizer, full=False))


class _RunsCodeWhenUnpickled:
    """Unpickling it creates the directory ``marker``; a hostile file could run anything there instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.mkdir, (str(self.marker),)


class _Hparams:
    def __init__(self, width: int) -> None:
        self.width = width


def _refused(load: Callable[[], object], marker: Path, what: str) -> None:
    with pytest.raises(ckpt.UnsafeCheckpointError, match=f"refused to (load|read) .*{what}") as info:
        load()
    assert "arbitrary code" in str(info.value) and "Only load checkpoints you trust" in str(info.value)
    assert not marker.exists()


def test_a_consolidated_file_that_runs_code_when_unpickled_is_refused(tmp_path: Path) -> None:
    model, optimizer = trained(split=False)
    hostile = tmp_path / "hostile.ckpt"
    marker = tmp_path / "code-ran"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": _RunsCodeWhenUnpickled(marker)}, hostile)
    _refused(lambda: ckpt.load_model_weights(hostile), marker, "weights-only.*posix.mkdir")
    _refused(lambda: ckpt.load_checkpoint(hostile, copy.deepcopy(model), [], strict=True), marker, "hostile.ckpt")
    torch.load(hostile, weights_only=False)  # the file is what it claims: a plain unpickling runs its code
    assert marker.exists()


def test_a_sharded_checkpoint_that_runs_code_when_unpickled_is_refused(tmp_path: Path) -> None:
    model, optimizer = trained(split=False)
    save(model, optimizer, tmp_path / "good.ckpt")
    marker = tmp_path / "code-ran"
    bad_meta = tmp_path / "bad-meta.ckpt"
    shutil.copytree(tmp_path / "good.ckpt", bad_meta)
    torch.save({"global_step": 2, "loops": _RunsCodeWhenUnpickled(marker)}, bad_meta / ckpt.META_NAME)
    _refused(lambda: ckpt.consolidate_checkpoint(bad_meta, tmp_path / "one.ckpt"), marker, "meta.pt.*weights-only")
    assert not (tmp_path / "one.ckpt").exists()
    metadata = ckpt._read_dcp_metadata(tmp_path / "good.ckpt")
    metadata.planner_data = _RunsCodeWhenUnpickled(marker)  # hidden inside otherwise valid metadata
    bad_dcp = tmp_path / "bad-dcp.ckpt"
    shutil.copytree(tmp_path / "good.ckpt", bad_dcp)
    (bad_dcp / ckpt.DCP_METADATA_NAME).write_bytes(pickle.dumps(metadata))
    for load in (lambda: ckpt.load_model_weights(bad_dcp), lambda: ckpt.check_checkpoint(bad_dcp),
                 lambda: ckpt.consolidate_checkpoint(bad_dcp, tmp_path / "one.ckpt"),
                 lambda: ckpt.load_checkpoint(bad_dcp, copy.deepcopy(model), [], strict=True)):
        _refused(load, marker, r"\.metadata: it names posix.mkdir")
    torch.distributed.checkpoint.FileSystemReader(bad_dcp).read_metadata()  # torch's own reader: plain pickle
    assert marker.exists()


def test_own_classes_in_a_trusted_checkpoint_load_when_allowed(tmp_path: Path) -> None:
    model, _ = trained(split=False)
    path = tmp_path / "hparams.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": {"config": _Hparams(16)}}, path)
    with pytest.raises(ckpt.UnsafeCheckpointError, match="_Hparams"):
        ckpt.load_model_weights(path)
    with torch.serialization.safe_globals([_Hparams]):  # what the refusal tells the user to do
        assert_same_state(ckpt.load_model_weights(path), model.state_dict())
    sharded = tmp_path / "sharded.ckpt"
    save(model, torch.optim.Adam(model.parameters()), sharded)
    metadata = ckpt._read_dcp_metadata(sharded)
    metadata.planner_data = _Hparams(16)
    (sharded / ckpt.DCP_METADATA_NAME).write_bytes(pickle.dumps(metadata))
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"\.metadata: it names .*_Hparams"):
        ckpt.load_model_weights(sharded)
    with torch.serialization.safe_globals([_Hparams]):
        assert_same_state(ckpt.load_model_weights(sharded), model.state_dict())
