"""osdp-train on one rank, recording what :mod:`benchmarks.pretrained_load` measures of that rank.

Run on every rank at once (:func:`benchmarks.launch.run_ranks`), with osdp-train's overrides::

    MALLOC_MMAP_THRESHOLD_=65536 python -m benchmarks.pretrained_load_worker model=hf_llama_110m \
        meta_init=true model.pretrained=DIR cluster.memory_budget=50%ddp hydra.run.dir=RUN

Runs ``osdp_lightning.cli.train`` unchanged and writes ``RUN/rank<N>.json`` at exit:

- ``load``: the :class:`~osdp_lightning.state.pretrained.LoadReport` of this rank (seconds, bytes read,
  tensors), when the strategy loaded pretrained weights (osdp-train logs rank 0's only);
- ``hwm_after_steps_bytes``: the resident high-water mark (``VmHWM``) after the last training
  step, before a checkpoint is written (and the resident set then: anonymous and file-backed pages);
  ``hwm_bytes``: at exit;
- ``setup_hwm_bytes``: at the start of ``fit`` (the model built, nothing planned or loaded yet);
- ``page_cache``: the share of the weight files the page cache held when the load began, and what
  ``OSDP_BENCH_PAGE_CACHE`` then made of it: ``warm`` (every file read once), ``cold`` (every file's
  pages dropped, ``posix_fadvise(DONTNEED)``), unset (as found); then a barrier, so that the ranks
  load together from that state.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import json
import mmap
import os
import sys
from pathlib import Path
from typing import Any

from osdp_lightning.integration.callbacks import TrainingSummary
from osdp_lightning.runtime.process_memory import process_status_bytes

RECORD: dict[str, Any] = {}
PAGE_CACHE_ENV = "OSDP_BENCH_PAGE_CACHE"


# -- the page cache of the weight files ---------------------------------------------------------------
def weight_files(path: str | Path) -> list[Path]:
    path = Path(path)
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path]


def drop_cache(files: list[Path]) -> None:
    """Evict the files' pages from the page cache (clean pages; no root needed)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(files: list[Path]) -> None:
    for file in files:
        with file.open("rb", buffering=0) as handle:
            while handle.read(1 << 24):
                pass


def resident_share(files: list[Path]) -> float:
    """The share of the files' pages the page cache holds (``mincore`` over a fresh mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    resident = pages = 0
    for file in files:
        size = file.stat().st_size
        with file.open("rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
            count = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vector = (ctypes.c_ubyte * count)()
            first = ctypes.c_char.from_buffer(mapped)  # NOTE: released before the mapping closes
            failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(size), vector)
            del first
            if failed:
                raise OSError(ctypes.get_errno(), "mincore failed")
            resident += count - bytes(vector).count(0)
            pages += count
    return resident / max(pages, 1)


def set_page_cache(path: str | Path, state: str) -> dict[str, Any]:
    """Put the weight files in ``state`` (``warm``, ``cold``, ``""``: as found); what it found first."""
    files = weight_files(path)
    found = resident_share(files)
    if state == "warm":
        warm_cache(files)
    elif state == "cold":
        drop_cache(files)
    elif state:
        raise ValueError(f"{PAGE_CACHE_ENV} is warm, cold or unset; got {state!r}")
    return {"resident_before": round(found, 4), "state": state or "as found"}


def run_dir(argv: list[str]) -> Path | None:
    """The ``hydra.run.dir=...`` override of ``argv``."""
    found = [a.split("=", 1)[1].strip("\"'") for a in argv if a.startswith("hydra.run.dir=")]
    return Path(found[-1]) if found else None


def _hwm_bytes() -> int:
    return process_status_bytes("VmHWM").get("VmHWM", 0)


def record_loads() -> None:
    """Keep each rank's LoadReport (osdp-train prints rank 0's only), the page cache set before it.
    NOTE: ``load_pretrained`` passes ``report.summary()`` to ``rank_zero_info`` on every rank:
    wrapping ``summary`` sees each rank's report wherever the strategy calls it from."""
    import torch.distributed as dist

    from osdp_lightning.integration import setup_core
    from osdp_lightning.state.pretrained import LoadReport

    summary, load = LoadReport.summary, setup_core.load_pretrained

    def recording(report: LoadReport) -> str:
        fields = dataclasses.asdict(report)
        RECORD["load"] = {k: fields[k] for k in ("path", "loaded", "cast", "bytes_read", "load_s")}
        RECORD["load"]["file_bytes"] = sum(os.path.getsize(f) for f in report.files)
        RECORD["load"]["hwm_after_load_bytes"] = _hwm_bytes()
        return summary(report)

    def loading(module: Any, source: Any) -> Any:
        path = source if isinstance(source, (str, Path)) else source.path
        RECORD["page_cache"] = set_page_cache(path, os.environ.get(PAGE_CACHE_ENV, ""))
        if dist.is_initialized():
            dist.barrier()  # every rank's load starts from the state set
        return load(module, source)

    LoadReport.summary = recording  # type: ignore[method-assign]
    setup_core.load_pretrained = loading


def record_high_water() -> None:
    """VmHWM at the start of ``fit`` and after every training step (the last one is kept)."""
    start, step_end = TrainingSummary.on_fit_start, TrainingSummary.on_train_batch_end

    def on_fit_start(self: TrainingSummary, *args: Any) -> None:
        RECORD["setup_hwm_bytes"] = _hwm_bytes()
        start(self, *args)

    def on_train_batch_end(self: TrainingSummary, *args: Any) -> None:
        step_end(self, *args)
        RECORD["hwm_after_steps_bytes"] = _hwm_bytes()
        RECORD["resident_after_steps"] = process_status_bytes("RssAnon", "RssFile")

    TrainingSummary.on_fit_start = on_fit_start  # type: ignore[method-assign]
    TrainingSummary.on_train_batch_end = on_train_batch_end  # type: ignore[method-assign]


def write_record(directory: Path) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    record = {"rank": rank, **RECORD, "hwm_bytes": _hwm_bytes(),
              "vm_data_bytes": process_status_bytes("VmData").get("VmData", 0)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank}.json").write_text(json.dumps(record, default=str) + "\n")


def main() -> None:
    directory = run_dir(sys.argv[1:])
    if directory is not None:
        atexit.register(write_record, directory)
    record_loads()
    record_high_water()
    from osdp_lightning.cli.train import main as train_main

    train_main()


if __name__ == "__main__":
    main()
