"""The two ways osdp profiles a model, side by side: whole (the real step of the whole model on
one device) and from shapes (a fake step for bytes, one real copy of each kind of unit for time).

    ./dev bench profile_paths [--shapes 4x256,6x768] [--seq-len 128] [--batch-size 4] [--rounds 3]

For each GPT shape (layers x width), in one process on this machine: seconds each way takes
(median of ``--rounds``, the two ways alternating), the predicted step, activation bytes and
per-unit seconds of each, and how far the from-shapes figures are from the whole profile's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from osdp_lightning.recipes.gpt import GPT, GPTConfig, GPTLitModule

from benchmarks.compare import load_average, source_commit
from osdp_lightning.choices import ChoiceOptions
from osdp_lightning.cost.budget import format_bytes
from osdp_lightning.plan.pipeline import ProfileOptions, profile_model
from osdp_lightning.profiling.optim_state import configured_optimizer
from osdp_lightning.profiling.records import ModelProfile


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4x256,6x768", help="GPT layers x width, comma-separated")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def profile_both(layers: int, width: int, args: argparse.Namespace) -> dict[str, list]:
    config = GPTConfig(vocab_size=384, block_size=args.seq_len, n_layer=layers, n_head=max(1, width // 64),
                       n_embd=width)
    tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens, "labels": tokens}
    options = ProfileOptions(choices=ChoiceOptions(split_factors=(2, 4, 8)))
    runs: dict[str, list] = {"whole": [], "shapes": []}
    for _ in range(args.rounds):
        for way in ("whole", "shapes"):
            torch.manual_seed(0)
            if way == "whole":
                module = GPTLitModule(GPT(config))
            else:
                with torch.device("meta"):
                    module = GPTLitModule(GPT(config))
            start = time.perf_counter()
            profile = profile_model(module, batch, torch.device("cpu"), options, whole=way == "whole",
                                    optimizer=configured_optimizer(module))
            runs[way].append((time.perf_counter() - start, profile))
    return runs


def row(shape: str, runs: dict[str, list]) -> str:
    seconds = {way: statistics.median(s for s, _ in r) for way, r in runs.items()}
    last: dict[str, ModelProfile] = {way: r[-1][1] for way, r in runs.items()}
    steps = {way: statistics.median(p.step_s for _, p in r) for way, r in runs.items()}
    blocks = {way: statistics.median(u.forward_s + u.backward_s for _, p in r for u in p.units if ".h." in u.name)
              for way, r in runs.items()}
    whole, shapes = last["whole"], last["shapes"]
    return (f"| {shape} | {seconds['whole']:.2f} | {seconds['shapes']:.2f} | {seconds['shapes'] / seconds['whole']:.2f}x "
            f"| {steps['whole'] * 1e3:.1f} | {steps['shapes'] * 1e3:.1f} | {steps['shapes'] / steps['whole'] - 1:+.1%} "
            f"| {blocks['shapes'] / blocks['whole'] - 1:+.1%} "
            f"| {format_bytes(whole.activation_bytes)} | {shapes.activation_bytes / whole.activation_bytes - 1:+.1%} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"commit {source_commit()}, load average {load_average()}, torch threads {torch.get_num_threads()}, "
          f"micro-batch {args.batch_size} x {args.seq_len} tokens, {args.rounds} rounds (medians)\n")
    print("| GPT | whole profile s | from shapes s | ratio | step ms (whole) | step ms (shapes) | step vs whole "
          "| block s vs whole | activations (whole) | activations vs whole |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        layers, width = (int(x) for x in shape.split("x"))
        print(row(shape, profile_both(layers, width, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
