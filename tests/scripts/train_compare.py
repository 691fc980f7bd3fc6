"""Train a toy model on 2 gloo ranks with a given strategy and write what happened as JSON.

Run as a script (Lightning's launcher re-runs this file for rank 1):
    python train_compare.py --model mlp --strategy osdp --budget 3MiB --out result.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from hand_layout import hand_layout_model, hand_layout_strategy  # noqa: E402
from toy_models import MODELS  # noqa: E402

import osdp_lightning  # noqa: E402,F401  (registers "osdp")
from osdp_lightning import ClusterSpec, OSDPStrategy, TrainingSummary  # noqa: E402
from osdp_lightning.plan.measure import profile_lightning_module  # noqa: E402
from osdp_lightning.plan.plan import Plan, fixed_plan  # noqa: E402
from osdp_lightning.runtime.clip import total_grad_norm  # noqa: E402
from osdp_lightning.runtime.replicate import replicate_reducer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--strategy", default="osdp", help="osdp, a Lightning strategy, or hand (--plan laid out "
                        "by hand: FSDP2 and DDP, hand_layout.py)")
    parser.add_argument("--uniform", default=None, help="replicate | zero2 | zero3")
    parser.add_argument("--budget", default=None)
    parser.add_argument("--budget-covers", default="tensors", help="process | tensors (the tests' budgets are "
                        "computed from the memory model's tensor peaks)")
    parser.add_argument("--plan", default=None, help="plan JSON to apply")
    parser.add_argument("--split-factors", default="2,4,8")
    parser.add_argument("--activation-checkpointing", default="auto", help="auto | never | always")
    parser.add_argument("--micro-batch", default=None, help="int or 'auto'")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--choices", default=None,
                        help="a hand-made plan, e.g. 'net.0=replicate;net.2=split(k=2, sharded=1)' (others zero3)")
    parser.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--clip-algorithm", default=None, help="norm | value")
    parser.add_argument("--accumulate", default="1", help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--foreach", action="store_true",
                        help="Adam(foreach=True): the multi-tensor step, a GPU's default")
    parser.add_argument("--keep-process-group", action="store_true",
                        help="end without destroy_process_group(), as many user scripts do")
    parser.add_argument("--compile", default=None, help="OSDPStrategy(compile=...): units")
    parser.add_argument("--user-compile", action="store_true",
                        help="wrap every block of the model's ModuleLists in torch.compile, as a user does")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    L.seed_everything(0, workers=True)
    model = hand_layout_model(MODELS[args.model], args.plan, args.precision) if args.strategy == "hand" \
        else MODELS[args.model]()
    model.optimizer_foreach = True if args.foreach else None
    if args.user_compile:
        for blocks in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
            for i, block in enumerate(blocks):
                blocks[i] = torch.compile(block)
    if args.strategy == "osdp":
        factors = tuple(int(k) for k in args.split_factors.split(",") if k)
        micro = args.micro_batch if args.micro_batch in (None, "auto") else int(args.micro_batch)
        plan = _hand_made_plan(model, args.devices, args.choices) if args.choices else args.plan
        strategy = OSDPStrategy(memory_budget=args.budget, uniform_choice=args.uniform, plan=plan,
                                split_factors=factors, micro_batch_size=micro,
                                activation_checkpointing=args.activation_checkpointing, compile=args.compile,
                                budget_covers=args.budget_covers)
    else:
        strategy = hand_layout_strategy(args.devices) if args.strategy == "hand" else args.strategy
    summary = TrainingSummary()
    norms = _GradNormRecorder()
    counter = _CollectiveCounter()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
                        precision=args.precision, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[summary, norms, counter],
                        deterministic=True, gradient_clip_val=args.clip,
                        gradient_clip_algorithm=args.clip_algorithm,
                        accumulate_grad_batches=_number(args.accumulate))
    trainer.fit(model)
    result = {"rank": trainer.global_rank, "losses": model.losses, "summary": summary.summary,
              "grad_norms": norms.norms, "step_calls": model.step_calls,
              "reductions_per_batch": counter.per_batch, "gathered_bytes_per_batch": counter.gathered_per_batch,
              "gathered_elements_per_batch": counter.gathered_elements_per_batch,
              "threads": torch.get_num_threads(), "setup_s": getattr(trainer.strategy, "setup_s", {}),
              "compiled_units": _compiled_units(trainer.strategy.model)}
    reducer = replicate_reducer(trainer.strategy.model) if args.strategy == "osdp" else None
    result["replicated_params"] = len(reducer.params) if reducer is not None else 0  # on DDP's reducer
    plan = getattr(trainer.strategy, "_plan", None)
    if plan is not None:
        result["plan"] = plan.to_dict()
    gathered = [None] * trainer.world_size
    if dist.is_initialized():
        dist.all_gather_object(gathered, result)
    else:
        gathered = [result]
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps(gathered, indent=1))
        if plan is not None:
            print(plan.format_table())
        print(summary.format())
    if dist.is_initialized() and not args.keep_process_group:
        dist.destroy_process_group()


class _CollectiveCounter(L.Callback):
    """Gradient reductions FSDP2 issues in each training batch (reduce-scatters and all-reduces), and
    the bytes its all-gathers gather (their outputs: every rank's shards)."""

    def __init__(self) -> None:
        self.per_batch: list[int] = []
        self.gathered_per_batch: list[int] = []
        self.gathered_elements_per_batch: list[int] = []
        self._count = self._gathered = self._elements = 0
        for name in ("reduce_scatter_single", "all_reduce"):
            if hasattr(dist, name):
                setattr(dist, name, self._counted(getattr(dist, name)))
        dist.all_gather_single = self._gathering(dist.all_gather_single)  # what FSDP2 calls

    def _gathering(self, collective):  # noqa: ANN001, ANN202
        def call(output, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            self._gathered += output.numel() * output.element_size()
            self._elements += output.numel()
            return collective(output, *args, **kwargs)
        return call

    def _counted(self, collective):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self._count += 1
            return collective(*args, **kwargs)
        return call

    def on_train_batch_start(self, *args) -> None:  # noqa: ANN002
        self._count = self._gathered = self._elements = 0

    def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
        self.per_batch.append(self._count)
        self.gathered_per_batch.append(self._gathered)
        self.gathered_elements_per_batch.append(self._elements)


class _GradNormRecorder(L.Callback):
    """The total gradient norm before clipping, at every optimizer step (any plan: osdp_lightning.runtime.clip)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:  # noqa: ANN001
        self.norms.append(float(total_grad_norm(pl_module.parameters())))


def _hand_made_plan(model: L.LightningModule, world_size: int, choices: str) -> Plan:
    """zero3 everywhere except the units named in ``choices`` ("unit=choice;..."; the root is "<root>")."""
    wanted = dict(item.split("=", 1) for item in choices.split(";"))
    wanted = {("" if name == "<root>" else name): choice for name, choice in wanted.items()}
    profile = profile_lightning_module(model, next(iter(model.train_dataloader())), repeats=1,
                                       optimizer=model.configure_optimizers())
    # memory does not depend on the split overhead's seconds: every k priced without timing it
    profile = dataclasses.replace(profile, units=tuple(
        dataclasses.replace(u, split_overhead_s=tuple((k, 0.0) for k in (2, 4, 8))) if u.linear_shape else u
        for u in profile.units))
    cluster = ClusterSpec(world_size=world_size, memory_budget_bytes=2**40, collective_latency_s=1e-4,
                          bandwidth_bytes_per_s=1e9)
    # the profile's own units (no unit set searched: the names are the default selection's)
    unknown = sorted(set(wanted) - {u.name for u in profile.units})
    if unknown:
        raise ValueError(f"no units named {unknown}; units: {[u.name for u in profile.units]}")
    assignment = [wanted.get(u.name, "zero3") for u in profile.units]
    # the hand-made assignment's own predicted peak, so that a run can compare its measured one;
    # a choice the cost model refuses here (hsdp(g=1), applied only to test its mesh) leaves it unpriced
    try:
        return fixed_plan(profile, cluster, assignment, source="hand-made")
    except ValueError as err:
        plan = fixed_plan(profile, cluster, ["zero3"] * len(assignment))
        units = tuple(dataclasses.replace(u, choice=c) for u, c in zip(plan.units, assignment, strict=True))
        return dataclasses.replace(plan, units=units, source=f"hand-made (peak not priced: {err})",
                                   predicted_peak_bytes=0)


def _compiled_units(model: torch.nn.Module) -> list[str]:
    from osdp_lightning.runtime.compile import is_compiled
    return [name for name, module in model.named_modules() if is_compiled(module)]


def _number(text: str) -> int | float:
    return float(text) if "." in text else int(text)


if __name__ == "__main__":
    main()
