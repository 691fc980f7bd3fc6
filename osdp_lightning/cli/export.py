"""``osdp-export CKPT DIR --config PRETRAINED_DIR``: an osdp checkpoint as a Hugging Face model directory.

    osdp-export checkpoints/last.ckpt finetuned/ --config llama-1b/ --max-shard-size 2GB

``CKPT`` is a checkpoint osdp saved (a sharded directory or a consolidated ``.ckpt``); ``DIR``
then loads with ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``. Runs in one process,
without a process group (:func:`osdp_lightning.state.export.export_hf`).
"""

from __future__ import annotations

import argparse
import sys

from osdp_lightning.cost.budget import format_bytes, parse_bytes
from osdp_lightning.state.export import export_hf


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osdp-export", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("checkpoint", help="a checkpoint osdp saved: a sharded directory or a consolidated .ckpt")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write (empty or new)")
    parser.add_argument("--config", required=True,
                        help="the pretrained model's directory: its config.json (and generation_config.json) is "
                             "copied, and its architecture gives the keys and tied weights")
    parser.add_argument("--max-shard-size", default="2GB",
                        help="largest safetensors file before the export is sharded (default 2GB)")
    parser.add_argument("--prefix", default=None,
                        help="what the checkpoint's keys have before the model's, e.g. 'net.' (default: found)")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Console script ``osdp-export``."""
    args = parser().parse_args(argv)
    try:
        max_shard_bytes = parse_bytes(args.max_shard_size)
    except ValueError:
        sys.exit(f"osdp-export: --max-shard-size {args.max_shard_size!r}: give a size such as 2GB, 500MB or 1GiB")
    try:
        report = export_hf(args.checkpoint, args.out_dir, args.config, max_shard_bytes=max_shard_bytes,
                           prefix=args.prefix)
    except (ValueError, OSError) as err:
        sys.exit(f"osdp-export: {err}")
    print(f"wrote {report.tensors} tensors ({format_bytes(report.total_bytes)}) in {len(report.files)} file(s) to "
          f"{report.out_dir} (checkpoint keys read with {report.key_map}"
          + (f"; tied, written once: {', '.join(report.tied_skipped)}" if report.tied_skipped else "")
          + (f"; not in the model, left out: {len(report.left_out)}" if report.left_out else "") + ")")


if __name__ == "__main__":
    main()
