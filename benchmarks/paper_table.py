"""The OSDP paper's settings, on paper: predicted throughput of osdp, zero3 (FSDP) and ddp.

    python benchmarks/paper_table.py                  # writes docs/paper_settings.md
    python benchmarks/paper_table.py --out table.md   # elsewhere

Every figure is a dry-run estimate (:mod:`osdp_lightning.plan.dryrun`): the model is built on fake
tensors, its FLOPs are counted and turned into seconds with the cluster config's peak FLOP/s
times ``DEFAULT_COMPUTE_EFFICIENCY``, and communication comes from the config's bandwidths. No
GPU is used. The settings follow the OSDP authors' scripts (github.com/Youhe-Jiang/
IJCAI2023-OptimalShardedDataParallel): ``gpt/scripts/script_gpt2_*.sh`` and ``opt/scripts/*.sh``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from osdp_lightning.choices import resolve
from osdp_lightning.cost.budget import format_bytes
from osdp_lightning.cost.cluster import ClusterSpec, describe_cluster, load_cluster_spec
from osdp_lightning.plan.dryrun import (
    DEFAULT_COMPUTE_EFFICIENCY,
    compose_config,
    dry_run_plan,
    estimate_profile,
    recipe_model_and_batch,
)
from osdp_lightning.plan.plan import InfeasibleBudgetError, Plan
from osdp_lightning.profiling.records import ModelProfile

DOCS = Path(__file__).resolve().parents[1] / "docs" / "paper_settings.md"
STRATEGIES = {"osdp": None, "zero3": str(resolve("zero3")), "ddp": str(resolve("ddp"))}


@dataclass(frozen=True)
class Setting:
    """One row group of the table: a model, a cluster, and the micro-batches each strategy may use."""

    name: str
    cluster: str
    """A ``conf/cluster`` name."""
    memory_budget: str | None
    """Per-rank limit (``None``: the config's)."""
    build: Callable[[], tuple[Callable[[], nn.Module], object, int]]
    """Returns a model factory, one batch (real or meta) and the tokens per sample."""
    precision: str
    micro_batches: dict[str, tuple[int, ...]]
    """Per strategy, the micro-batch sizes tried (the fastest that fits is kept)."""
    reported: dict[str, float] = field(default_factory=dict)
    """Throughput the OSDP authors report, in their unit (see ``reported_unit``)."""
    reported_unit: str = ""
    headroom_bytes: int | None = None
    """Overrides the config's headroom (the paper's limit counts allocated tensors only)."""
    in_reported_unit: Callable[[Plan], float] | None = None
    """Our prediction in the authors' unit, where their script shows how they computed it."""


def gpt_shape(n_layer: int, n_embd: int, n_head: int, vocab: int, block: int, seq: int,
              micro_batch: int) -> Callable[[], tuple[Callable[[], nn.Module], object, int]]:
    """A GPT of the given shape (the recipe's GPT: 4x MLP, tied head) and a meta batch."""
    def build() -> tuple[Callable[[], nn.Module], object, int]:
        from osdp_lightning.recipes.gpt import GPT, GPTConfig, GPTLitModule

        config = GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        tokens = torch.empty(micro_batch, seq, dtype=torch.long, device="meta")
        return (lambda: GPTLitModule(GPT(config))), {"input_ids": tokens, "labels": tokens}, seq
    return build


def recipe(model_name: str) -> Callable[[], tuple[Callable[[], nn.Module], object, int]]:
    return lambda: recipe_model_and_batch(compose_config([f"model={model_name}"]))


SETTINGS = (
    # Authors' GPT script: minGPT on 2-digit addition (vocab 10, 6 tokens), 48 layers, hidden 1536,
    # 48 heads, 96 sequences per GPU for both systems, fp32 Adam, 8 GB limit.
    Setting("GPT 48L h1536 (paper)", "titan_rtx_24g_x8", "8GiB", gpt_shape(48, 1536, 48, 10, 6, 6, 96),
            "32-true", {"osdp": (96,), "zero3": (96,), "ddp": (96,)},
            {"osdp": 192.26, "zero3": 158.05}, "their seq/s", headroom_bytes=0,
            # their script prints micro_batch * 6 / step_s on rank 0 (6 tokens per sample)
            in_reported_unit=lambda plan: plan.micro_batch_size * 6 / plan.predicted_step_s),
    # Authors' OPT script: HF OPT, 8 layers, hidden 7168, ffn 28672, 56 heads, vocab 50272; batch 2
    # per GPU for OSDP, 1 for FSDP; sequence length of their BERT sample data (assumed 128).
    Setting("OPT-30B-shaped 8L h7168 (paper)", "titan_rtx_24g_x8", "16GiB",
            gpt_shape(8, 7168, 56, 50272, 2048, 128, 1), "32-true",
            {"osdp": (2,), "zero3": (1,), "ddp": (1,)}, {"osdp": 1262.0, "zero3": 453.0}, "their seq/s",
            headroom_bytes=0),
    Setting("gpt_xl (1.56B)", "h100_80g_x8x2", None, recipe("gpt_xl"), "bf16-mixed",
            dict.fromkeys(STRATEGIES, (4, 8, 16, 32))),
    Setting("t5_large (738M)", "h100_80g_x8x2", None, recipe("t5_large"), "bf16-mixed",
            dict.fromkeys(STRATEGIES, (16, 32, 64, 128))),
)


@dataclass(frozen=True)
class Row:
    setting: Setting
    strategy: str
    plan: Plan | None
    compute_s: float
    """Predicted compute seconds of the step (the rest of ``predicted_step_s`` is exposed communication)."""


def best_plan(model: Callable[[], nn.Module], profile: ModelProfile, cluster: ClusterSpec, strategy: str,
              micro_batches: tuple[int, ...], time_limit_s: float) -> Plan | None:
    """The fastest plan of ``strategy`` that fits, over ``micro_batches``; ``None`` if none fits."""
    uniform = STRATEGIES[strategy]
    if uniform is None:  # one solve per micro-batch; make_plan keeps the fastest that fits
        try:
            return dry_run_plan(model, None, cluster, profile=profile, micro_batch_sizes=micro_batches,
                                time_limit_s=time_limit_s)
        except InfeasibleBudgetError:
            return None
    usable = cluster.usable_bytes
    plans = [dry_run_plan(model, None, cluster, profile=profile, uniform_choice=uniform, micro_batch_sizes=(b,))
             for b in micro_batches]
    return max((p for p in plans if p.bounded_peak_bytes <= usable), key=lambda p: p.predicted_throughput,
               default=None)


def run_setting(setting: Setting, time_limit_s: float) -> tuple[list[Row], ClusterSpec]:
    cluster = load_cluster_spec(setting.cluster, setting.memory_budget)
    if setting.headroom_bytes is not None:
        cluster = ClusterSpec(**{**cluster.__dict__, "headroom_bytes": setting.headroom_bytes, "headroom_fraction": 0.0})
    model, batch, _ = setting.build()
    profile = estimate_profile(model, batch, peak_flops_per_s=cluster.peak_flops_per_s or 0.0,
                               precision=setting.precision)
    rows = []
    for strategy in STRATEGIES:
        plan = best_plan(model, profile, cluster, strategy, setting.micro_batches[strategy], time_limit_s)
        compute_s = profile.step_s * plan.micro_batch_size / profile.micro_batch_size if plan else 0.0
        rows.append(Row(setting, strategy, plan, compute_s))
    return rows, cluster


def format_rows(rows: list[Row]) -> list[str]:
    """Markdown rows: ours next to the authors' (their unit where known, and their osdp/FSDP ratio)."""
    reference = next((r.plan for r in rows if r.strategy == "zero3" and r.plan), None)
    reported = rows[0].setting.reported
    paper_ratio = reported["osdp"] / reported["zero3"] if reported else None
    lines = []
    for row in rows:
        plan, setting = row.plan, row.setting
        theirs = reported.get(row.strategy)
        theirs_text = f"{theirs:g} {setting.reported_unit}" if theirs else "-"
        if plan is None:
            lines.append(f"| {setting.name} | {row.strategy} | - | does not fit | - | - | - | - | - | {theirs_text} | - |")
            continue
        if theirs and setting.in_reported_unit:
            theirs_text += f" (ours: {setting.in_reported_unit(plan):.0f})"
        solver = "optimal" if plan.solver_status in ("Optimal", "Fixed") else f"gap {plan.gap or 0:.2%}"
        ratio = plan.predicted_throughput / reference.predicted_throughput if reference else float("nan")
        paper = f"{paper_ratio:.2f}x" if paper_ratio and row.strategy == "osdp" else "-"
        lines.append(
            f"| {setting.name} | {row.strategy} | {plan.micro_batch_size} | {format_bytes(plan.predicted_peak_bytes)} "
            f"| {plan.predicted_step_s:.3f} | {row.compute_s:.3f} | {plan.predicted_throughput:,.1f} | "
            f"**{ratio:.2f}x** | {solver} | {theirs_text} | {paper} |")
    return lines


def choice_summary(plan: Plan | None) -> str:
    if plan is None:
        return "no plan fits"
    return plan.choices_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DOCS)
    parser.add_argument("--time-limit-s", type=float, default=30.0,
                        help="CBC time limit per solve (tight budgets on ~300 units: optimality is slow to prove)")
    args = parser.parse_args()
    start = time.perf_counter()
    table = ["| setting | strategy | micro-batch | peak/rank | step s | of which compute s | samples/s (all ranks) "
             "| vs zero3 | solver | reported | reported osdp/FSDP |", "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    clusters, choices = [], []
    for setting in SETTINGS:
        rows, cluster = run_setting(setting, args.time_limit_s)
        table += format_rows(rows)
        clusters.append(f"- {setting.name}: `{setting.cluster}`, budget {format_bytes(cluster.memory_budget_bytes)} "
                        f"per rank of which {format_bytes(cluster.headroom_bytes)} kept free, {setting.precision}; "
                        f"{describe_cluster(cluster)}")
        choices.append(f"- {setting.name}: {choice_summary(rows[0].plan)}")
        print(f"{setting.name}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    text = render(table, clusters, choices, time.perf_counter() - start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


def render(table: list[str], clusters: list[str], choices: list[str], elapsed_s: float) -> str:
    return "\n".join([HEADER, "", *table, "", "Clusters (from `conf/cluster`):", "", *clusters, "",
                      "What the osdp plans chose:", "", *choices, "", ASSUMPTIONS.format(
                          efficiency=DEFAULT_COMPUTE_EFFICIENCY, elapsed=elapsed_s), "", CHECKPOINTING, ""])


CHECKPOINTING = """## GPT 48 layers x hidden 2048 under 8 GB: activation checkpointing per unit

Not generated by this script: `osdp-plan experiment=paper_gpt_48l_8g model.net.config.n_embd=2048`
(a dry run for `titan_rtx_24g_x8`, fp32 Adam, 1024 tokens per sample, 2.5B parameters; 2026-11-30).
The authors' code cannot plan it: it has no activation checkpointing, and without it no plan fits.

| strategy | micro-batch | predicted peak/rank | fits 8 GiB |
|---|---:|---:|---|
| osdp (`activation_checkpointing="auto"`) | 8 | 6.94 GiB | yes: zero3+ckpt x29, zero3 x18, zero2 x2, replicate(+ckpt) x3 |
| zero3 | 1 | 13.75 GiB | no |
| zero2 | 1 | 22.76 GiB | no |
| ddp | 1 | 46.24 GiB | no |

Only memory is shown: the dry run's compute estimate for this shape (84 s per sample) is far above
6 x parameters x tokens FLOPs at the cluster's peak (about 2.4 s) and is not trusted yet."""

HEADER = """# The OSDP paper's settings, on paper

Generated by `python benchmarks/paper_table.py`. Every number in the osdp / zero3 / ddp rows is a
**dry-run estimate from a cluster description**, not a measurement: no GPU was used."""

ASSUMPTIONS = """## What drives the difference from the reported numbers

1. **Compare ratios, not absolute figures.** The authors' GPT "seq/s" is `micro-batch x 6 / step
   seconds` printed on rank 0 (samples of 6 tokens, per GPU); the table converts our prediction to
   that unit. Their OPT figure's unit cannot be recovered from their scripts: 1262 sequences of 128
   tokens per second through a 5.3B-parameter model would need about 5e15 FLOP/s, some 40x the fp32
   peak of 8 TITAN RTX. Only its osdp/FSDP ratio is comparable.
2. **Compute efficiency.** Compute seconds are the FLOPs FlopCounterMode counts on fake tensors
   divided by the cluster's peak FLOP/s times {efficiency} (`DEFAULT_COMPUTE_EFFICIENCY`). The paper's
   GPT steps multiply 576-token matrices (96 samples x 6 tokens) in fp32 on TITAN RTX; the authors'
   measured steps (3.0 s and 3.6 s, from 192 and 158 "seq/s") are about twice ours, which a lower
   efficiency (0.15-0.2) or a slower PCIe link would reproduce. Both move osdp and FSDP together,
   the ratio much less.
3. **Bandwidth and overlap.** `titan_rtx_24g_x8` assumes a 10 GB/s NCCL bus bandwidth over PCIe 3.0
   and that 50% of a collective hides behind neighbouring compute. osdp beats zero3 by the
   all-gathers it avoids (replicate and zero2 units keep their parameters), so its gain grows with
   exposed communication (step minus compute in the table): a slower link or less overlap brings
   the predicted 1.17x-ish towards the paper's 1.22x.
4. **OPT: batch sizes and the baseline.** The authors ran OSDP at 2 sequences per GPU against FSDP
   at 1; so does the table. The step is communication-bound (compare the compute column with the
   step), so doubling the batch nearly doubles throughput: about 2x of the reported 2.8x is the
   batch. The rest came from their baseline, `FSDP(model)`: one fairscale unit that gathers the
   whole model without prefetch. Our zero3 is per-unit FSDP2 with prefetch overlap, a stronger
   baseline. Their sequence length is that of their BERT sample data (assumed 128 here; the
   communication that dominates does not depend on it).
5. **Memory.** The paper's limit counts allocated tensors, so these rows use no headroom. The
   authors measured 8057 MB for OSDP (it fills the budget, as our plan does) and 5657 MB for FSDP,
   to set against the zero3 row's predicted peak.
6. **`h100_80g_x8x2`.** bf16 autocast (fp32 weights, their bf16 copies saved for backward), 989
   TFLOP/s peak at the same efficiency, NVLink 360 GB/s inside a node, 45 GB/s per GPU across nodes
   (one 400 Gb/s NIC each), 80% overlap, 2 GiB headroom. The cross-node link is the bottleneck:
   zero3 all-gathers (twice) and reduce-scatters over all 16 ranks at 45 GB/s, ddp all-reduces
   every gradient across it. osdp has two more choices there: `hsdp(g=8)` all-gathers and
   reduce-scatters inside the node and sends only 1/8 of each gradient across, and
   `zero3(reshard=8)` keeps the backward all-gather inside the node; it mixes them with replicate
   where memory allows (see "What the osdp plans chose"). Each strategy is shown at its fastest
   micro-batch that fits (powers of two).
7. **Not modelled.** Kernel choice and fusion, NCCL algorithm selection (rings vs trees), several
   rings sharing PCIe switches, CPU launch overhead, allocator fragmentation (the headroom stands in
   for it on the H100 rows), and the memory-bound operations FlopCounterMode does not count (folded
   into the efficiency). The solver has a time limit per solve; "gap" is CBC's distance from a
   proven optimum when it stopped.

Generated in {elapsed:.0f} s on a 2-core CPU machine."""


if __name__ == "__main__":
    main()
