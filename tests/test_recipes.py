"""The recipes without any strategy: shapes, masks, data objectives, and that loss goes down."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from osdp_lightning.recipes.bert import Bert, BertConfig, BertDataModule
from osdp_lightning.recipes.gpt import GPT, GPTConfig, GPTDataModule
from osdp_lightning.recipes.t5 import T5, T5Config, T5SpanCorruptionDataModule
from osdp_lightning.recipes.t5.data import corrupt_spans
from osdp_lightning.recipes.t5.model import relative_position_bucket
from osdp_lightning.recipes.t5.module import shift_right
from osdp_lightning.recipes.t5.tasks import TaskDataset
from osdp_lightning.recipes.text import (
    EOS_ID,
    FIRST_SENTINEL_ID,
    MASK_ID,
    PAD_ID,
    decode,
    encode,
    python_docs_corpus,
)


def test_byte_tokenizer_round_trips_unicode() -> None:
    text = "naïve café — λ"
    assert decode(encode(text)) == text
    assert decode([104, 105, MASK_ID, FIRST_SENTINEL_ID + 2, EOS_ID]) == "hi<mask><s2></s>"


def test_default_corpus_is_real_text_on_this_machine() -> None:
    text = python_docs_corpus()
    assert len(text) > 500_000
    assert "Return" in text and "argument" in text


def test_text_files_override_reads_your_own_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world " * 100)
    (tmp_path / "b.txt").write_text("second file " * 100)
    data = GPTDataModule(seq_len=16, batch_size=2, text_files=str(tmp_path / "*.txt"))
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (2, 16)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    with pytest.raises(FileNotFoundError, match="no files match"):
        GPTDataModule(16, 2, text_files=str(tmp_path / "*.md")).setup("fit")


def test_gpt_is_causal_and_tied() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16)).eval()
    assert model.lm_head.weight is model.wte.weight
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    logits, logits_changed = model(idx), model(changed)
    assert logits.shape == (2, 16, 384)
    assert torch.allclose(logits[:, :10], logits_changed[:, :10], atol=1e-6)
    assert not torch.allclose(logits[:, 10:], logits_changed[:, 10:])


def test_bert_masks_about_fifteen_percent_and_sees_both_ways() -> None:
    torch.manual_seed(0)
    data = BertDataModule(seq_len=128, batch_size=64)
    windows = [torch.randint(0, 256, (128,)) for _ in range(64)]
    batch = data.collate(windows)
    chosen = batch["labels"] != -100
    assert 0.12 < chosen.float().mean() < 0.18
    assert (batch["input_ids"][chosen] == MASK_ID).float().mean() > 0.7
    assert torch.equal(batch["input_ids"][~chosen], torch.stack(windows)[~chosen])
    model = Bert(BertConfig()).eval()
    assert model.mlm_head.decoder.weight is model.word_embeddings.weight
    idx = torch.randint(0, 256, (1, 32))
    changed = idx.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    assert not torch.allclose(model(idx)[0, 0], model(changed)[0, 0])  # the last token is seen by the first


def test_span_corruption_hides_and_restores_the_window() -> None:
    torch.manual_seed(0)
    window = encode("The quick brown fox jumps over the lazy dog, again and again.")
    inputs, targets = corrupt_spans(window, noise_density=0.15, mean_span_len=3.0)
    assert inputs[-1] == EOS_ID and targets[-1] == EOS_ID
    # Put every hidden span back in place of its sentinel: the window comes back.
    spans: dict[int, list[int]] = {}
    current = None
    for t in targets[:-1].tolist():
        if t >= FIRST_SENTINEL_ID:
            current = t
            spans[current] = []
        else:
            spans[current].append(t)
    restored = [b for t in inputs[:-1].tolist() for b in (spans[t] if t >= FIRST_SENTINEL_ID else [t])]
    assert restored == window.tolist()
    data = T5SpanCorruptionDataModule(seq_len=len(window), batch_size=1)
    assert (len(inputs), len(targets)) == (data.input_len, data.target_len)


def test_generated_tasks_have_correct_answers() -> None:
    dataset = TaskDataset(["copy", "reverse", "sort", "add"], max_len=12, num_samples=40, seed=0)
    for i in range(40):
        sample = dataset[i]
        source = decode(sample["input_ids"][sample["attention_mask"]]).removesuffix("</s>")
        answer = decode(sample["labels"][sample["labels"] != -100]).removesuffix("</s>")
        task, payload = source.split(": ", 1)
        solve = {"copy": lambda p: p, "reverse": lambda p: p[::-1], "sort": lambda p: "".join(sorted(p)),
                 "add": lambda p: str(sum(int(x) for x in p.split("+")))}[task]
        expected = solve(payload)
        assert answer == expected, (source, answer)
    assert dataset[3]["input_ids"].tolist() == dataset[3]["input_ids"].tolist()


def test_t5_relative_buckets_and_causal_decoder() -> None:
    relative = torch.arange(-200, 201)
    both = relative_position_bucket(relative, bidirectional=True, num_buckets=32, max_distance=128)
    back = relative_position_bucket(relative, bidirectional=False, num_buckets=32, max_distance=128)
    assert both.min() == 0 and both.max() == 31 and back.max() == 31
    assert len(set(both[relative.abs() < 8].tolist())) == 15  # exact buckets near the query
    assert (back[relative > 0] == 0).all()  # the decoder never looks ahead
    torch.manual_seed(0)
    model = T5(T5Config()).eval()
    src, mask = torch.randint(0, 256, (2, 12)), torch.ones(2, 12, dtype=torch.bool)
    labels = torch.randint(0, 256, (2, 8))
    dec, dec_changed = shift_right(labels), shift_right(labels)
    dec_changed[:, 5:] = PAD_ID
    out, out_changed = model(src, mask, dec), model(src, mask, dec_changed)
    assert out.shape == (2, 8, 384)
    assert torch.allclose(out[:, :5], out_changed[:, :5], atol=1e-5)
    # Padding keys of the encoder input change nothing.
    padded = torch.cat([src, torch.full((2, 4), PAD_ID)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(2, 4, dtype=torch.bool)], dim=1)
    assert torch.allclose(model(padded, padded_mask, dec), out, atol=1e-5)


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from intra-op threads, and lose a lot when other work shares the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("overrides", [["model=gpt_tiny"], ["model=bert_tiny"], ["model=t5_tiny"],
                                       ["model=t5_tiny", "data=t5_tasks"]],
                         ids=["gpt", "bert", "t5_span", "t5_tasks"])
def test_loss_goes_down_on_default_data(overrides: list[str], tmp_path: Path, one_thread: None) -> None:
    """40 steps of the tiny size, one process, the recipe's default data: loss drops clearly."""
    with initialize_config_module("osdp_lightning.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"output_dir={tmp_path}"])
    pl.seed_everything(0)
    recorder = _LossRecorder()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=40, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[recorder], default_root_dir=tmp_path)
    trainer.fit(instantiate(cfg.model), datamodule=instantiate(cfg.data))
    first, last = recorder.losses[0], sum(recorder.losses[-5:]) / 5
    assert first > 5.0  # about ln(384) at initialisation
    assert last < first - 1.5, recorder.losses
