"""Exact resume, and resume under another plan and another world size (real 2-rank gloo runs).

One chain of runs of tests/scripts/ckpt_run.py (toy MLP, Adam, StepLR per step, resumable loader):

    a: 20 steps straight, plan MIXED (replicate, zero3, zero2, split and a zero3 root)
    b: 10 steps, plan MIXED, sharded checkpoints at steps 5 and 10 (ModelCheckpoint) and after fit
       (trainer.save_checkpoint), then the processes end
    c: resume b's step 10 with plan MIXED in a new process group, to step 20
    d: resume b's step 10 with plan OTHER (split and whole layers swapped), consolidated saves
    e: resume b's step 10 on 1 rank (a single-device plan), to step 15, sharded save
    f: resume e's step 15 on 2 ranks with a solved plan, to step 20
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_launch import run_alone, run_ranks, script  # noqa: E402
from ckpt_plans import MIXED, OTHER, fixed_plan  # noqa: E402
from toy_models import MLP  # noqa: E402

from osdp_lightning.state import checkpoint as ckpt  # noqa: E402

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]
WIDTH = 64


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("resume")
    fixed_plan(MLP(width=WIDTH), 2, MIXED).save(work / "mixed.json")
    fixed_plan(MLP(width=WIDTH), 2, OTHER).save(work / "other.json")
    step10 = str(work / "ckpt_b" / "step=10.ckpt")
    chain = {
        "a": ["--steps", "20", "--plan", "mixed.json"],
        "b": ["--steps", "10", "--plan", "mixed.json", "--ckpt-dir", "ckpt_b", "--ckpt-every", "5", "--save-after"],
        "c": ["--steps", "20", "--plan", "mixed.json", "--resume", step10],
        "d": ["--steps", "20", "--plan", "other.json", "--resume", step10, "--consolidated",
              "--ckpt-dir", "ckpt_d", "--ckpt-every", "10"],
        "e": ["--devices", "1", "--steps", "15", "--resume", step10, "--ckpt-dir", "ckpt_e", "--ckpt-every", "5"],
        "f": ["--steps", "20", "--budget", "1GiB", "--resume", str(work / "ckpt_e" / "step=15.ckpt")],
    }
    for name, args in chain.items():
        launch = run_alone if "--devices" in args else run_ranks  # one process, or 2 ranks started together
        done = launch([script("ckpt_run.py"), *args, "--out", name], work / f"{name}.log", 240, cwd=work)
        assert done.returncode == 0, f"run {name} failed:\n{done.log[-6000:]}"
    return work


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def differences(a: object, b: object, where: str = "") -> list[tuple[str, float]]:
    """Every tensor (or value) that differs between two nested states, with the largest |a - b|."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list):
        assert len(a) == len(b), where
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        return [] if torch.equal(a, b) else [(where, (a.double() - b.double()).abs().max().item())]
    return [] if a == b else [(where, float("nan"))]


def whole(state: dict) -> dict:
    return {"model": state["model"], "optimizers": state["optimizers"]}


def steps(run: Path) -> list[list[dict]]:
    return [rank["steps"] for rank in json.loads((run / "record.json").read_text())]


def test_resume_is_bitwise_exact(runs: Path) -> None:
    # the state loaded in c is the state b saved, tensor for tensor
    assert differences(whole(load(runs / "b" / "final.pt")), whole(load(runs / "c" / "start.pt"))) == []
    # 10 + 10 steps end exactly where 20 straight steps end: weights and Adam state, bitwise
    assert differences(load(runs / "a" / "final.pt"), load(runs / "c" / "final.pt")) == []
    # steps 11..20 saw the same learning rates, the same batches in the same order, the same losses
    for straight, resumed in zip(steps(runs / "a"), steps(runs / "c"), strict=True):
        assert [s["step"] for s in resumed] == list(range(11, 21))
        assert resumed == straight[10:]


def test_sharded_checkpoint_is_canonical_and_written_by_every_rank(runs: Path) -> None:
    path = runs / "ckpt_b" / "step=10.ckpt"
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    model = {k.removeprefix("state_dict."): tuple(v.size) for k, v in saved.items() if k.startswith("state_dict.")}
    assert model == {k: tuple(v.shape) for k, v in MLP(width=WIDTH).state_dict().items()}
    optimizer_keys = {k.split(".state.")[1].rsplit(".", 1)[0] for k in saved if k.startswith("optimizer_0.state.")}
    assert optimizer_keys == set(model)  # net.4 was split(k=2): its slices never appear
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    marker = json.loads((path / ckpt.MARKER_NAME).read_text())
    assert marker["global_step"] == 10 and marker["world_size"] == 2 and marker["plan"] == MIXED
    assert ckpt.find_latest_checkpoint(runs / "ckpt_b").name in ("step=10.ckpt", "last.ckpt")
    # trainer.save_checkpoint after fit writes the same layout with the same tensors
    after_fit = ckpt.load_model_weights(runs / "b" / "after_fit.ckpt")
    assert differences(after_fit, ckpt.load_model_weights(path)) == []


def test_resume_under_another_plan(runs: Path) -> None:
    assert differences(whole(load(runs / "b" / "final.pt")), whole(load(runs / "d" / "start.pt"))) == []
    assert json.loads((runs / "d" / "record.json").read_text())[0]["plan"] == OTHER
    # NOTE: not bitwise: a split layer sums k partial products, a whole one computes one product,
    # so float rounding differs in the last bits (and grows slowly over the 10 steps).
    worst = max(d for _, d in differences(load(runs / "a" / "final.pt"), load(runs / "d" / "final.pt")))
    assert worst < 1e-6


def test_resume_from_two_ranks_to_one_and_back(runs: Path) -> None:
    assert differences(whole(load(runs / "b" / "final.pt")), whole(load(runs / "e" / "start.pt"))) == []
    log_e = (runs / "e.log").read_text()
    assert "one process, nothing to shard across" in log_e and "single-device plan" in log_e
    assert set(json.loads((runs / "e" / "record.json").read_text())[0]["plan"].values()) == {"replicate"}
    assert differences(whole(load(runs / "e" / "final.pt")), whole(load(runs / "f" / "start.pt"))) == []
    assert json.loads((runs / "f" / "record.json").read_text())[0]["global_step"] == 20


def test_checkpoints_load_into_the_plain_module(runs: Path) -> None:
    # consolidated: Lightning's own load_from_checkpoint, no osdp involved
    plain = MLP.load_from_checkpoint(runs / "ckpt_d" / "step=20.ckpt", width=WIDTH)
    assert differences(plain.state_dict(), load(runs / "d" / "final.pt")["model"]) == []
    # sharded: one process, no process group
    plain = MLP(width=WIDTH)
    plain.load_state_dict(ckpt.load_model_weights(runs / "ckpt_b" / "step=10.ckpt"))
    assert differences(plain.state_dict(), load(runs / "b" / "final.pt")["model"]) == []
