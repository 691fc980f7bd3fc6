"""Pretrained weights into the sharded model, and the fine-tuned model out as a Hugging Face directory.

In-process tests read real files written here (``save_pretrained``, ``safetensors``, ``torch.save``)
into plain and split modules: names, strictness, damaged sources, dtypes. The 2-rank runs
fine-tune a tiny Llama written by ``save_pretrained`` (sharded, so its index is read) under a
hand-made plan with every kind of choice, built eagerly and on the meta device, then export it.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import CliHere
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ckpt_launch import SCRIPTS, run_ranks  # noqa: E402
from pretrained_train import CONFIG, HAND_MADE, LAYER  # noqa: E402

from osdp_lightning import PretrainedWeights, load_pretrained  # noqa: E402
from osdp_lightning.runtime.split import split_linear_in_module  # noqa: E402
from osdp_lightning.state.checkpoint import UnsafeCheckpointError, consolidate_checkpoint  # noqa: E402
from osdp_lightning.state.export import export_hf  # noqa: E402
from osdp_lightning.state.weight_files import (  # noqa: E402
    KeyMap,
    PretrainedWeightsError,
    best_key_map,
    open_weights,
    run_start,
)

hf = pytest.importorskip("transformers")
_PREADV = os.preadv
REPO = Path(__file__).resolve().parents[1]
SPLIT = [name.removeprefix(f"{LAYER}.") for name, choice in HAND_MADE.items() if choice.startswith("split")]


class Holder(nn.Module):
    """As a LightningModule holds a Hugging Face model: ``self.net``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = hf.LlamaForCausalLM(hf.LlamaConfig(**CONFIG))


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (tied embedding) written by ``save_pretrained`` in four shards with an index."""
    path = tmp_path_factory.mktemp("pretrained") / "llama"
    torch.manual_seed(0)
    hf.LlamaForCausalLM(hf.LlamaConfig(**CONFIG)).save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    return path


def reference(path: Path) -> nn.Module:
    return hf.AutoModelForCausalLM.from_pretrained(path)


def assert_same_weights(module: nn.Module, expected: dict[str, torch.Tensor], prefix: str = "net.") -> None:
    state = module.state_dict()
    assert {prefix + k for k in expected} == set(state)
    for key, value in expected.items():
        assert torch.equal(state[prefix + key], value.to(state[prefix + key].dtype)), key


# -- names ------------------------------------------------------------------------------------
def test_file_keys_find_the_module_prefix_and_the_base_model_prefix() -> None:
    module = ["net.model.embed_tokens.weight", "net.model.layers.0.mlp.up_proj.weight", "net.model.norm.weight",
              "net.lm_head.weight"]
    causal_lm = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert best_key_map(causal_lm, module) == KeyMap("", "net.")
    base_model = [k.removeprefix("model.") for k in causal_lm]  # saved from LlamaModel: no "model."
    assert best_key_map(base_model, module) == KeyMap("", "net.model.")
    assert best_key_map(causal_lm, [k.removeprefix("net.model.") for k in module]) == KeyMap("model.", "")
    assert best_key_map(causal_lm, module, add="net.") == KeyMap("", "net.")
    assert best_key_map(["other.weight"], module) == KeyMap("", "")  # nothing matches: nothing renamed
    assert KeyMap("model.", "net.")("model.norm.weight") == "net.norm.weight"
    assert KeyMap("model.", "net.")("lm_head.weight") is None


def test_a_hugging_face_directory_loads_into_plain_and_split_layers_ties_kept(pretrained_dir: Path) -> None:
    model = Holder(seed=1)
    split_linear_in_module(model, "net.model.layers.1.self_attn.o_proj", 2)
    report = load_pretrained(model, pretrained_dir)
    expected = reference(pretrained_dir)
    assert_same_weights(model, expected.state_dict())
    assert model.net.lm_head.weight is model.net.model.embed_tokens.weight
    assert (report.loaded, report.key_map, report.cast) == (20, KeyMap("", "net."), 0)  # lm_head: tied, read once
    assert len(report.files) == len(list(pretrained_dir.glob("*.safetensors")))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    # NOTE: the split layer sums its two halves' products: equal up to rounding
    torch.testing.assert_close(model.net(input_ids=ids).logits, expected(input_ids=ids).logits)


def test_a_base_model_file_loads_into_its_lm_with_old_buffers_in_it(tmp_path: Path) -> None:
    """GPT-2 as it is published: the base model's keys (``h.0...``, no ``transformer.``), and the
    causal mask ``h.N.attn.bias`` that GPT-2 no longer saves (a non-persistent buffer now)."""
    config = hf.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                           eos_token_id=0)
    torch.manual_seed(2)
    base = hf.GPT2Model(config)
    save_file({**base.state_dict(), **{f"h.{i}.attn.bias": torch.ones(1, 1, 16, 16) for i in range(2)}},
              tmp_path / "gpt2.safetensors")
    model = nn.Module()
    model.net = hf.GPT2LMHeadModel(config)
    report = load_pretrained(model, tmp_path / "gpt2.safetensors")
    assert report.key_map == KeyMap("", "net.transformer.") and not report.unexpected
    assert torch.equal(model.net.transformer.h[1].mlp.c_fc.weight, base.h[1].mlp.c_fc.weight)
    assert torch.equal(model.net.lm_head.weight, base.wte.weight)  # tied to the embedding


def test_a_bf16_file_is_cast_into_an_fp32_model(tmp_path: Path) -> None:
    source = Holder(seed=2).net.to(torch.bfloat16)
    source.save_pretrained(tmp_path / "bf16")
    model = Holder(seed=1)
    report = load_pretrained(model, PretrainedWeights(str(tmp_path / "bf16" / "model.safetensors"), prefix="net."))
    assert report.cast == report.loaded == 20
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_same_weights(model, source.state_dict())


def test_a_torch_state_dict_file_loads_as_one_with_its_lightning_wrapping(tmp_path: Path) -> None:
    source = Holder(seed=2)
    torch.save(source.state_dict(), tmp_path / "plain.pt")
    torch.save({"state_dict": source.state_dict(), "epoch": 3}, tmp_path / "lightning.ckpt")
    for name in ("plain.pt", "lightning.ckpt"):
        model = Holder(seed=1)
        assert load_pretrained(model, tmp_path / name).key_map == KeyMap()
        assert_same_weights(model, source.state_dict(), prefix="")


# -- strict: one clear error before anything is written ------------------------------------------
def _mlp(width: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))


def test_missing_unexpected_and_misshaped_keys_are_one_error_naming_them(tmp_path: Path) -> None:
    weights = {k: v for k, v in _mlp().state_dict().items() if k != "2.bias"}
    weights["0.weight"] = torch.zeros(4, 5)
    weights.update({f"extra.{i}": torch.zeros(1) for i in range(7)})
    save_file(weights, tmp_path / "w.safetensors")
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PretrainedWeightsError) as err:
        load_pretrained(model, tmp_path / "w.safetensors")
    message = str(err.value)
    assert "1 missing" in message and "2.bias" in message
    assert "7 unexpected" in message and "extra.0" in message and "2 more" in message
    assert "1 mis-shaped" in message and "0.weight: file [4, 5], model [4, 4]" in message
    assert "strict=False" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing half-loaded
    report = load_pretrained(model, PretrainedWeights(str(tmp_path / "w.safetensors"), strict=False))
    assert (report.loaded, report.missing, len(report.unexpected)) == (2, ("2.bias",), 7)
    assert torch.equal(model[0].bias, weights["0.bias"]) and torch.equal(model[0].weight, before["0.weight"])


def test_a_file_for_another_model_says_which_prefix_to_give(tmp_path: Path) -> None:
    save_file({"encoder.proj.weight": torch.zeros(2, 2)}, tmp_path / "w.safetensors")
    with pytest.raises(PretrainedWeightsError, match=r"No key of the file names a tensor.*prefix="):
        load_pretrained(_mlp(), tmp_path / "w.safetensors")


def test_a_truncated_safetensors_file_is_refused(tmp_path: Path) -> None:
    save_file(_mlp().state_dict(), tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(data[:-7])
    with pytest.raises(PretrainedWeightsError, match=r"w.safetensors is not a complete safetensors file"):
        load_pretrained(_mlp(), tmp_path / "w.safetensors")


def test_a_box_of_one_run_is_read_straight_into_its_tensor_others_through_the_mapping(tmp_path: Path) -> None:
    assert run_start((4, 6), (slice(1, 3), slice(0, 6))) == 6  # a rank's rows: one run
    assert run_start((4, 6), (slice(1, 2), slice(2, 5))) == 8
    assert run_start((4, 6), (slice(1, 3), slice(2, 5))) is None  # a split slice's columns: one run per row
    assert run_start((2, 3, 4), (slice(0, 1), slice(1, 3), slice(0, 4))) == 4
    assert run_start((2, 3, 4), (slice(0, 2), slice(1, 2), slice(0, 4))) is None
    assert run_start((), ()) == 0
    tensors = {"m": torch.arange(24.0).reshape(4, 6), "c": torch.arange(24.0).reshape(2, 3, 4), "s": torch.tensor(7.0),
               "h": torch.arange(6.0, dtype=torch.bfloat16)}
    save_file(tensors, tmp_path / "w.safetensors")
    fd = os.open(tmp_path / "w.safetensors", os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: the runs ahead are asked for
    os.close(fd)
    reads = [("m", (slice(1, 3), slice(0, 6))), ("m", (slice(1, 3), slice(2, 5))), ("s", ()),
             ("c", (slice(0, 2), slice(1, 3), slice(1, 4))), ("c", (slice(1, 2), slice(0, 3), slice(0, 4))),
             ("h", (slice(2, 5),))]
    outs = [torch.full(tuple(b.stop - b.start for b in box), -1.0) for _, box in reads]  # fp32: "h" is cast
    outs.append(torch.empty(6, 4).t())  # not contiguous: through the mapping
    reads.append(("m", (slice(0, 4), slice(0, 6))))
    preadv = []
    with open_weights(tmp_path / "w.safetensors") as files, pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "preadv", lambda fd, views, offset, *flags: preadv.append(offset) or _PREADV(fd, views, offset, *flags))
        files.will_read((name, box, out) for (name, box), out in zip(reads, outs, strict=True))
        for (name, box), out in zip(reads, outs, strict=True):
            assert files.read_into(name, box, out) == (name == "h")
            assert torch.equal(out, tensors[name][box].float()), (name, box)
        assert files.bytes_read == 4 * (12 + 6 + 1 + 12 + 12 + 24) + 2 * 3
    starts = {name: files.infos[name].offset_bytes for name in tensors}
    assert sorted(set(preadv)) == sorted({starts["m"] + 4 * 6, starts["s"], starts["c"] + 4 * 12})  # the runs only


def test_a_file_cut_short_after_it_was_opened_is_an_error_not_a_crash(tmp_path: Path) -> None:
    """Reads are ``os.preadv``, not page faults on a mapped file (a ``SIGBUS`` past its end)."""
    path = tmp_path / "w.safetensors"
    save_file(_mlp(64).state_dict(), path)
    with open_weights(path) as files:
        last = max(files.infos, key=lambda n: files.infos[n].offset_bytes)
        os.truncate(path, path.stat().st_size - 100)
        shape = files.infos[last].shape
        with pytest.raises(PretrainedWeightsError, match=rf"w.safetensors is not a complete safetensors file .*{last} ends"):
            files.read_into(last, tuple(slice(0, n) for n in shape), torch.empty(shape))


def test_a_truncated_torch_file_is_refused(tmp_path: Path) -> None:
    torch.save(_mlp().state_dict(), tmp_path / "w.pt")
    (tmp_path / "w.pt").write_bytes((tmp_path / "w.pt").read_bytes()[:-100])
    with pytest.raises(PretrainedWeightsError, match=r"w.pt is not a complete torch.save file"):
        load_pretrained(_mlp(), tmp_path / "w.pt")


def test_an_index_naming_a_missing_shard_is_refused(pretrained_dir: Path, tmp_path: Path) -> None:
    broken = shutil.copytree(pretrained_dir, tmp_path / "broken")
    (broken / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(PretrainedWeightsError, match=r"names 1 shard\(s\) that are not in .*model-00002-of-00004"):
        load_pretrained(Holder(seed=1), broken)


class _RunsCode:
    def __reduce__(self) -> tuple:
        return (print, ("this ran while loading",))


def test_a_torch_file_whose_pickle_would_run_code_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    torch.save({"0.weight": torch.zeros(4, 4), "hook": _RunsCode()}, tmp_path / "w.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"refused to load pretrained weights .*w.pt.*GLOBAL print"):
        load_pretrained(_mlp(), tmp_path / "w.pt")
    assert "this ran" not in capsys.readouterr().out


def test_osdp_imports_safetensors_and_transformers_only_when_it_reads() -> None:
    """``import osdp_lightning`` must work without the ``hf`` extra: no module imports them at its top."""
    for path in (REPO / "osdp_lightning").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("safetensors", "transformers") for n in names), path


def test_export_refuses_a_directory_with_weights_and_a_checkpoint_lacking_tensors(pretrained_dir: Path,
                                                                                   tmp_path: Path) -> None:
    state = {f"net.{k}": v for k, v in reference(pretrained_dir).state_dict().items()}
    torch.save({"state_dict": state}, tmp_path / "one.ckpt")
    with pytest.raises(ValueError, match="already holds model weights"):
        export_hf(tmp_path / "one.ckpt", pretrained_dir, pretrained_dir)
    del state["net.model.norm.weight"]
    torch.save({"state_dict": state}, tmp_path / "less.ckpt")
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of the model \(model.norm.weight\)"):
        export_hf(tmp_path / "less.ckpt", tmp_path / "out", pretrained_dir)


# -- 2 ranks: fine-tune under a mixed plan, then export ------------------------------------------
def _run(tmp_path: Path, pretrained: Path, *args: str) -> list[dict]:
    out = tmp_path / "run.json"
    finished = run_ranks([str(SCRIPTS / "pretrained_train.py"), "--pretrained", str(pretrained), "--ckpt",
                          str(tmp_path / "run.ckpt"), "--out", str(out), *args], tmp_path / "run.log", timeout_s=240)
    assert finished.returncode == 0, finished.log[-3000:]
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory: pytest.TempPathFactory, pretrained_dir: Path) -> tuple[Path, list[dict]]:
    tmp_path = tmp_path_factory.mktemp("eager")
    return tmp_path, _run(tmp_path, pretrained_dir)


def _assert_first_losses_are_the_pretrained_models(ranks: list[dict], pretrained_dir: Path) -> None:
    expected = reference(pretrained_dir)
    for rank in ranks:
        assert "error" not in rank, rank
        ids = torch.tensor(rank["first_batch"])
        with torch.no_grad():
            loss = float(expected(input_ids=ids, labels=ids).loss)
        assert rank["losses"][0] == pytest.approx(loss, rel=1e-6)
    assert ranks[0]["first_batch"] != ranks[1]["first_batch"]


@pytest.mark.multiprocess
def test_pretrained_weights_arrive_under_every_kind_of_choice(eager_run: tuple[Path, list[dict]],
                                                              pretrained_dir: Path) -> None:
    """A randomly initialised model, sharded by a plan with every kind of choice, then loaded: its
    first loss on each rank is the pretrained model's on that rank's batch, computed without osdp."""
    _, ranks = eager_run
    assert ranks[0]["plan"] == HAND_MADE
    _assert_first_losses_are_the_pretrained_models(ranks, pretrained_dir)


@pytest.mark.multiprocess
def test_each_rank_reads_only_the_rows_it_keeps(eager_run: tuple[Path, list[dict]], pretrained_dir: Path) -> None:
    _, ranks = eager_run
    file_elements = {k: v.numel() for k, v in reference(pretrained_dir).state_dict().items() if k != "lm_head.weight"}
    for rank in ranks:
        held: dict[str, int] = {}
        for name, count in rank["held"].items():  # a split layer's slices: one canonical weight
            key = name.removeprefix("net.").replace(".slices.0", "").replace(".slices.1", "")
            held[key] = held.get(key, 0) + count
        read = {k: sum(v) for k, v in rank["reads"].items()}  # the bytes os.preadv read, placed by the header
        assert set(rank["slice_reads"]) == {f"{LAYER}.{n}.weight".removeprefix("net.") for n in SPLIT}  # columns
        for name, counts in rank["slice_reads"].items():
            read[name] = read.get(name, 0) + sum(counts)
        assert read == held  # exactly what it keeps, each tied tensor once
        assert read["model.embed_tokens.weight"] == file_elements["model.embed_tokens.weight"] // 2  # zero3
        assert read["model.layers.1.mlp.down_proj.weight"] == file_elements["model.layers.1.mlp.down_proj.weight"]
        assert read["model.layers.1.self_attn.o_proj.weight"] == 3 * file_elements["model.norm.weight"] ** 2 // 4
        assert sum(read.values()) < 0.6 * sum(file_elements.values())


@pytest.mark.multiprocess
def test_the_export_loads_with_from_pretrained_bit_for_bit(eager_run: tuple[Path, list[dict]], pretrained_dir: Path,
                                                           cli_here: CliHere) -> None:
    """From the sharded checkpoint (export_hf) and from its consolidated file (osdp-export)."""
    tmp_path, _ = eager_run
    trained = torch.load(tmp_path / "run.json.final.pt")
    report = export_hf(tmp_path / "run.ckpt", tmp_path / "export", pretrained_dir, max_shard_bytes=100_000)
    assert report.key_map == KeyMap("net.", "") and report.tied_skipped == ("net.lm_head.weight",)
    assert len(report.files) > 1 and (tmp_path / "export" / "model.safetensors.index.json").is_file()
    consolidate_checkpoint(tmp_path / "run.ckpt", tmp_path / "one.ckpt")
    run = cli_here("export", str(tmp_path / "one.ckpt"), str(tmp_path / "export_one"), "--config", str(pretrained_dir),
                   "--prefix", "net.", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "wrote 20 tensors" in run.stdout and "tied, written once: net.lm_head.weight" in run.stdout
    for out in ("export", "export_one"):
        exported = hf.AutoModelForCausalLM.from_pretrained(tmp_path / out)
        assert exported.lm_head.weight is exported.model.embed_tokens.weight
        state = exported.state_dict()
        assert {f"net.{k}" for k in state} == set(trained)
        assert all(torch.equal(state[k.removeprefix("net.")], v) for k, v in trained.items())
        assert not torch.equal(state["model.norm.weight"], reference(pretrained_dir).model.norm.weight)  # trained


@pytest.mark.multiprocess
def test_a_model_built_on_the_meta_device_gets_the_pretrained_weights(tmp_path: Path, pretrained_dir: Path) -> None:
    ranks = _run(tmp_path, pretrained_dir, "--meta", "--steps", "1")
    _assert_first_losses_are_the_pretrained_models(ranks, pretrained_dir)


@pytest.mark.multiprocess
def test_a_shard_missing_from_the_index_stops_every_rank_before_training(tmp_path: Path, pretrained_dir: Path) -> None:
    broken = shutil.copytree(pretrained_dir, tmp_path / "broken")
    (broken / "model-00003-of-00004.safetensors").unlink()
    for rank in _run(tmp_path, broken):
        assert "PretrainedWeightsError" in rank["error"] and "model-00003-of-00004" in rank["error"], rank
