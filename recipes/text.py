"""Text that is already on the machine, a byte tokenizer, and the windowed data module every recipe uses.

The default corpus needs no download: the reference documentation that ships with CPython
(``pydoc_data.topics``, the text ``help("with")`` prints) followed by the docstrings of the
standard-library modules, about 1.3 MB of English technical prose. Point any recipe at your own
text with one override, ``data.text_files='/path/to/*.txt'`` (a glob or a list of globs).

Tokens are UTF-8 bytes (ids 0-255) plus a few special ids above them, so every recipe works on
any text without a vocabulary file.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import glob
import hashlib
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

PAD_ID = 256
"""Padding, and the decoder start token of T5."""
EOS_ID = 257
"""End of sequence."""
MASK_ID = 258
"""The ``[MASK]`` token of BERT's masked-language-model objective."""
FIRST_SENTINEL_ID = 259
"""T5 span corruption replaces the i-th dropped span by ``FIRST_SENTINEL_ID + i``."""
NUM_SENTINELS = 100
VOCAB_SIZE = FIRST_SENTINEL_ID + NUM_SENTINELS
"""Ids a byte-level recipe can produce (359); model configs round this up to 384."""


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D int64 tensor of token ids."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(ids: Sequence[int] | torch.Tensor) -> str:
    """Text of the byte ids in ``ids``; special ids are shown as ``<pad>``, ``<mask>``, ``<s3>``..."""
    out, chunk = [], bytearray()
    for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
        if i < 256:
            chunk.append(i)
            continue
        out.append(chunk.decode("utf-8", errors="replace"))
        chunk = bytearray()
        out.append({PAD_ID: "<pad>", EOS_ID: "</s>", MASK_ID: "<mask>"}.get(i, f"<s{i - FIRST_SENTINEL_ID}>"))
    out.append(chunk.decode("utf-8", errors="replace"))
    return "".join(out)


@functools.lru_cache(maxsize=1)
def python_docs_corpus() -> str:
    """CPython's shipped reference topics plus the docstrings of the top-level stdlib modules.

    Built once per Python installation (parsing the stdlib takes a second or more) and kept in
    ``~/.cache/osdp_lightning/`` (``$XDG_CACHE_HOME`` if set); every rank of every run reads it.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(f"{sys.version}|{stdlib}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "osdp_lightning" / f"python-docs-{key}.txt"
    if cache.is_file():
        return cache.read_text(encoding="utf-8")
    text = _build_python_docs_corpus(stdlib)
    with contextlib.suppress(OSError):  # a read-only home only costs the rebuild next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, cache)  # atomic: ranks building it at once never see half a file
    return text


def _build_python_docs_corpus(stdlib: Path) -> str:
    parts: list[str] = []
    try:
        from pydoc_data.topics import topics  # stripped from some minimal Python builds

        parts.extend(topics[name] for name in sorted(topics))
    except ImportError:
        pass
    for path in sorted(stdlib.glob("*.py")):
        parts.extend(_docstrings(path))
    if not parts:
        raise RuntimeError(f"found no documentation text under {stdlib}; pass data.text_files=...")
    return "\n\n".join(parts)


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return []
    nodes = (n for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef))
    return [doc for node in nodes if (doc := ast.get_docstring(node))]


def read_text_files(patterns: str | Sequence[str]) -> str:
    """The concatenated contents of every file matching ``patterns`` (globs, ``~`` allowed)."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    paths = sorted({p for pattern in patterns for p in glob.glob(str(Path(pattern).expanduser()), recursive=True)})
    files = [Path(p) for p in paths if Path(p).is_file()]
    if not files:
        raise FileNotFoundError(f"no files match data.text_files={patterns}")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


class WindowDataset(Dataset):
    """Non-overlapping windows of ``window_len`` tokens cut from one long token stream."""

    def __init__(self, tokens: torch.Tensor, window_len: int) -> None:
        if len(tokens) < window_len:
            raise ValueError(f"{len(tokens)} tokens is fewer than one window of {window_len}")
        self.tokens = tokens
        self.window_len = window_len

    def __len__(self) -> int:
        return len(self.tokens) // self.window_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.window_len
        return self.tokens[start : start + self.window_len]  # (window_len,)


class TextWindowDataModule(pl.LightningDataModule):
    """Byte windows of a text corpus, turned into a recipe's batches by :meth:`collate`.

    Subclasses set :attr:`window_len` (tokens cut per sample) and override :meth:`collate`
    (a list of windows to a dict of tensors) and :attr:`tokens_per_sample`.
    """

    def __init__(self, seq_len: int, batch_size: int, text_files: str | Sequence[str] | None = None,
                 val_fraction: float = 0.05, num_workers: int = 0) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.text_files = text_files
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.train_set: WindowDataset | None = None
        self.val_set: WindowDataset | None = None

    @property
    def window_len(self) -> int:
        return self.seq_len

    @property
    def tokens_per_sample(self) -> int:
        """Tokens the model processes per sample (what tokens/s counts)."""
        return self.seq_len

    @property
    def vocab_size(self) -> int:
        """Token ids this data can contain; the model's embedding must be at least this large."""
        return VOCAB_SIZE

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        text = read_text_files(self.text_files) if self.text_files else python_docs_corpus()
        tokens = encode(text)
        n_val = max(self.window_len, int(len(tokens) * self.val_fraction))
        self.train_set = WindowDataset(tokens[:-n_val], self.window_len)
        self.val_set = WindowDataset(tokens[-n_val:], self.window_len)

    def collate(self, windows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          collate_fn=self.collate, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, drop_last=True,
                          collate_fn=self.collate, num_workers=self.num_workers)
