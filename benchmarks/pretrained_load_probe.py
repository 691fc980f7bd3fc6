"""Where a rank's pretrained load spends its time: one process per measurement, no training.

    python -m benchmarks.pretrained_load_probe [--dir DIR] [--repeats 3] [--whole]   # ways of reading
    python -m benchmarks.pretrained_load_probe --ranks [--repeats 3]                 # load_pretrained, 2 ranks

Saves ``model=hf_llama_110m`` into ``--dir`` once. Per page cache state (``cold``: the file's pages
dropped, ``posix_fadvise(DONTNEED)``; ``warm``: the file read once) and per way of reading, a fresh
process fills destination tensors as rank 0 of 2 keeps them (the first half of the rows of every
2-D tensor, 1-D tensors whole; ``--whole``: every tensor whole), each tensor touched first as an
initialised model's is:

- ``get_slice``: ``safe_open(...).get_slice(name)[rows]`` (a view of the mapped file) then ``copy_``;
- ``pread``: ``os.preadv`` of the same bytes straight into each destination tensor;
- ``osdp``: :func:`osdp_lightning.state.pretrained.load_pretrained` into a module of the file's
  tensors (``--whole`` only).

``--ranks``: 2 ranks (:func:`benchmarks.launch.run_ranks`), each building the Llama on meta,
``fully_shard`` per layer and at the root, then ``load_pretrained`` timed phase by phase. One
thread per rank, as Lightning gives each of 2 ranks on 2 cores. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.pretrained_load_worker import drop_cache, warm_cache

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("get_slice", "pread", "osdp")


def boxes_of(file: Path, whole: bool) -> dict[str, tuple[slice, ...]]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        shapes = {n: handle.get_slice(n).get_shape() for n in handle.keys()}
    rows = 1 if whole else 2
    return {n: (slice(0, s[0] // rows), *(slice(0, d) for d in s[1:])) if len(s) == 2
            else tuple(slice(0, d) for d in s) for n, s in shapes.items()}


def measure(way: str, file: Path, whole: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    boxes = boxes_of(file, whole)
    dest = {n: torch.ones([b.stop - b.start for b in box]) for n, box in boxes.items()}
    if way == "get_slice":
        from safetensors import safe_open

        start, slice_s = time.perf_counter(), 0.0
        with safe_open(str(file), framework="pt") as handle:
            for name, box in boxes.items():
                begin = time.perf_counter()
                block = handle.get_slice(name)[box]
                slice_s += time.perf_counter() - begin
                dest[name].copy_(block)
        total_s = time.perf_counter() - start
        return {"total_s": total_s, "get_slice_s": slice_s, "copy_s": total_s - slice_s}
    if way == "pread":
        start = time.perf_counter()
        with file.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
            for name, out in dest.items():
                memory = (ctypes.c_char * (out.numel() * out.element_size())).from_address(out.data_ptr())
                os.preadv(handle.fileno(), [memoryview(memory).cast("B")], 8 + length + header[name]["data_offsets"][0])
        return {"total_s": time.perf_counter() - start}
    from osdp_lightning.state.pretrained import load_pretrained

    assert whole, "the osdp way reads whole tensors (--whole)"
    module = nn.Module()
    for name, tensor in dest.items():  # a module tree with the file's names
        *path, leaf = name.split(".")
        parent = module
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.register_buffer(leaf, tensor)
    start = time.perf_counter()
    report = load_pretrained(module, file)
    return {"total_s": time.perf_counter() - start, "load_s": report.load_s}


# -- 2 ranks: load_pretrained into an FSDP2-sharded Llama, phase by phase --------------------------
def rank_load(directory: Path) -> dict[str, Any]:
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import fully_shard

    from osdp_lightning.state import pretrained

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(1.0)  # touched, as an initialised model's are
    phases: dict[str, float] = {}
    for name in ("_live_model", "open_weights", "_match", "_write"):
        setattr(pretrained, name, _timed(getattr(pretrained, name), name, phases))
    dist.barrier()
    start = time.perf_counter()
    report = pretrained.load_pretrained(model, directory)
    return {"rank": dist.get_rank(), "total_s": time.perf_counter() - start, "load_s": report.load_s,
            "bytes_read": report.bytes_read, **phases}


def _timed(fn: Any, name: str, phases: dict[str, float]) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[f"{name}_s"] = phases.get(f"{name}_s", 0.0) + time.perf_counter() - start
    return timed


def launch_ranks(directory: Path, work: Path) -> list[dict[str, Any]]:
    from benchmarks.launch import run_ranks

    log = work / "ranks.log"
    code = run_ranks([sys.executable, "-m", "benchmarks.pretrained_load_probe", "--dir", str(directory),
                      "--rank-load"], log, 600, env={**os.environ, "PYTHONWARNINGS": "ignore"}, cwd=ROOT)
    if code != 0:
        raise RuntimeError(log.read_text()[-3000:])
    return [json.loads(line.split("RESULT ", 1)[1]) for line in log.read_text().splitlines() if "RESULT " in line]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/osdp_probe_llama110m"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--whole", action="store_true", help="every tensor whole (as one process loads)")
    parser.add_argument("--ranks", action="store_true", help="2-rank launches of load_pretrained (FSDP2) instead")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank-load", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    file = args.dir / "model.safetensors"
    if args.rank_load:
        print("RESULT " + json.dumps(rank_load(args.dir)), flush=True)
        os._exit(0)  # NOTE: gloo's threads may abort the interpreter's own exit ("terminate called")
    if args.one:
        print(json.dumps({"way": args.one, **measure(args.one, file, args.whole)}), flush=True)
        return 0
    if not file.is_file():
        from benchmarks.pretrained_load import save_model

        print(json.dumps(save_model("hf_llama_110m", [], args.dir, seed=0)), flush=True)
    for cache in ("cold", "warm"):
        for _ in range(args.repeats):
            for way in ["ranks"] if args.ranks else args.ways.split(","):
                drop_cache([file]) if cache == "cold" else warm_cache([file])
                if way == "ranks":
                    with tempfile.TemporaryDirectory() as work:
                        for record in launch_ranks(args.dir, Path(work)):
                            print(json.dumps({"cache": cache, **record}), flush=True)
                    continue
                cmd = [sys.executable, "-m", "benchmarks.pretrained_load_probe", "--dir", str(args.dir), "--one", way,
                       *(["--whole"] if args.whole else [])]
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True,
                                      env={**os.environ, "PYTHONWARNINGS": "ignore"})
                print(json.dumps({"cache": cache, **json.loads(done.stdout.strip().splitlines()[-1])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
