"""Pretrained weights into a sharded model on 2 CPU ranks: load time, memory, correctness, export.

    ./dev bench pretrained_load [--parts load,long,export,matrix] [--budget 70%ddp] [--repeats 3]
                                [--long-seq-len 1024 --long-budget 50%ddp]
                                [--matrix llama:2x64,gpt2:2x64,llama:1x32] [--out-dir docs/benchmarks/pretrained_load]
    ./dev bench pretrained_load --report-only DIR/pretrained_load_runs.json[.gz] --out-dir DIR

Nothing is downloaded: every model is ``save_pretrained`` from a config into a temporary directory.
Every launch is osdp-train (:mod:`benchmarks.pretrained_load_worker`: each rank's LoadReport and
resident high-water mark too), both ranks started at once (:mod:`benchmarks.launch`).

- ``load``: ``model=hf_llama_110m`` (12 x 768 Llama, fp32 safetensors, 438 MB). Before each osdp
  launch, in a fresh process, ``AutoModelForCausalLM.from_pretrained(DIR)`` timed 3 times (median;
  the first call too), alone and followed by reading every weight once, the file put in the page
  cache before each call as before osdp's load (this VM pages out a file idle for a minute, and
  the first launch solves for minutes). osdp-train ``meta_init=true model.pretrained=DIR`` at
  ``--budget`` (its DDP state does not fit) with ``MALLOC_MMAP_THRESHOLD_=65536`` as
  docs/benchmarks/capacity/README.md measures memory: the first launch solves the plan, the next
  ``--repeats - 1`` train from it (``strategy.plan=``), and one more loads from a cold page cache,
  beside ``from_pretrained`` timed with the file's pages dropped before each call.
  The same plan built eagerly with ``from_pretrained`` on every rank, Lightning's ``ddp`` from the
  same directory, and a 1 x 16 Llama through each of those commands (the fixed cost: interpreter,
  torch, gloo, Lightning, transformers; and osdp's calibration where the plan is solved).
- ``long``: the same model at ``--long-seq-len`` and ``--long-budget`` (50%ddp at sequence 1024:
  activations make DDP's peak large enough that half of it fits a plan), built on meta from the
  same directory, ``--long-steps`` steps; and the 1 x 16 Llama through the same command.
- ``matrix``: per tiny family and shape, Lightning's ``ddp`` from a saved directory against osdp at
  ``60%ddp`` and at 5% above the smallest budget osdp names (read from a launch at ``25%ddp``),
  built on meta (osdp loads), built eagerly with random weights (osdp loads), and built eagerly
  by ``from_pretrained`` on every rank; 8 steps each, losses from ``csv/metrics.csv``.
- ``export``: the last ``load`` launch saves its checkpoint; ``osdp-export`` to a Hugging Face
  directory is timed, and ``from_pretrained`` of it compared bit for bit with the checkpoint.

Writes ``pretrained_load.md`` (:mod:`benchmarks.pretrained_load_report`) and
``pretrained_load_runs.json`` (every record) into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import pretrained_load_report as report
from benchmarks import pretrained_load_worker as worker
from benchmarks.compare import describe_machine, load_average
from benchmarks.launch import run_ranks
from benchmarks.runs_file import read_runs

ROOT = Path(__file__).resolve().parents[1]
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc serves large blocks by mmap and gives them back on free: the resident set follows the tensors."""
SMOKE = ("trainer=smoke", "+trainer.enable_progress_bar=false")
TINY_LLAMA = ("model.hf_config.num_hidden_layers=1", "model.hf_config.hidden_size=16",
              "model.hf_config.num_attention_heads=2", "model.hf_config.num_key_value_heads=2",
              "model.hf_config.intermediate_size=32", "model.hf_config.vocab_size=384",
              "model.hf_config.tie_word_embeddings=false")
"""Overrides of ``model=hf_llama_110m`` that leave a 1 x 16 Llama: the fixed cost of the same command."""
FAMILIES = {"llama": "hf_llama_tiny", "gpt2": "hf_gpt2_tiny", "neox": "hf_neox_tiny"}
CHECKPOINT = ("trainer.enable_checkpointing=true", "trainer.check_val_every_n_epoch=1", "trainer.val_check_interval=1.0")
"""A checkpoint at the end of training (ModelCheckpoint saves at the epoch's end when nothing validates)."""
PROBE_BUDGET = "25%ddp"
"""A budget no plan fits (the tiny cases' smallest is 55-65%ddp), yet one that holds osdp's setup (about 3x
the largest unit; below it osdp says so instead of naming the smallest budget)."""
SHARE_BUDGET = "60%ddp"
ABOVE_SMALLEST = 1.05


class Progress:
    """The records so far, written after every launch (``machine.complete`` false until the end): a
    run stopped part-way keeps what it measured, and ``--report-only`` renders it."""
    saved: dict[str, Any] = {}
    path: Path | None = None

    @classmethod
    def write(cls) -> None:
        if cls.path is not None:
            cls.path.write_text(json.dumps(cls.saved, indent=1, default=str) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrained_load", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="load,long,export,matrix")
    parser.add_argument("--budget", default="70%ddp", help="the 110M model's budget per rank (load part)")
    parser.add_argument("--probe-budget", default="50%ddp",
                        help="a budget also tried first, recording what osdp says of it ('' to skip)")
    parser.add_argument("--repeats", type=int, default=3, help="osdp launches of the 110M model (medians)")
    parser.add_argument("--steps", type=int, default=4, help="training steps of the 110M model (>= 3)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--model-overrides", default="",
                        help="space-separated overrides of model=hf_llama_110m for the saved model "
                             "(e.g. model.hf_config.num_hidden_layers=2: a quick trial)")
    parser.add_argument("--no-ddp", action="store_true", help="skip Lightning's ddp launch of the 110M model")
    parser.add_argument("--no-cold", action="store_true", help="skip the launch that loads from a cold page cache")
    parser.add_argument("--long-seq-len", type=int, default=1024)
    parser.add_argument("--long-budget", default="50%ddp")
    parser.add_argument("--long-steps", type=int, default=3)
    parser.add_argument("--matrix", default="llama:2x64,gpt2:2x64,llama:1x32",
                        help="correctness cases, FAMILY:BATCHxSEQ (micro-batch x data.seq_len)")
    parser.add_argument("--matrix-steps", type=int, default=8)
    parser.add_argument("--run-timeout-s", type=float, default=1800.0)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_out/pretrained_load"))
    parser.add_argument("--report-only", type=Path, default=None, metavar="RUNS_JSON",
                        help="render the report of an earlier pretrained_load_runs.json (or .json.gz) into --out-dir")
    parser.add_argument("--time-from-pretrained", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--page-cache", default="warm", help=argparse.SUPPRESS)
    return parser


# -- models saved to disk -----------------------------------------------------------------------
def save_model(model: str, overrides: list[str], directory: Path, seed: int) -> dict[str, Any]:
    """``save_pretrained`` of the recipe's model (random weights from ``seed``) into ``directory``."""
    import torch
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    with initialize_config_module("osdp_lightning.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model}", "output_dir=/tmp/unused", *overrides])
    torch.manual_seed(seed)
    net = instantiate(cfg.model).net
    net.save_pretrained(directory)
    files = sorted(directory.glob("*.safetensors"))
    return {"dir": str(directory), "param_count": sum(p.numel() for p in net.parameters()),
            "file_bytes": sum(f.stat().st_size for f in files), "type": type(net).__name__}


def time_from_pretrained(directory: Path, cache: str, calls: int = 3) -> dict[str, Any]:
    """In this (fresh) process: ``from_pretrained(directory)`` ``calls`` times, alone and then with
    every weight read once (transformers maps the file: the call itself reads no weight); before each
    call the file is put in the page cache (``cache="warm"``) or dropped from it (``"cold"``)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):  # NOTE: imports the modelling code, as the meta-built osdp run did
        transformers.AutoModelForCausalLM.from_config(config)
    call_s, read_s, held = [], [], []
    for _ in range(calls):
        held.append(worker.set_page_cache(directory, cache)["resident_before"])
        start = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        call_s.append(time.perf_counter() - start)
        with torch.no_grad():
            sum(float(p.sum()) for p in model.parameters())
        read_s.append(time.perf_counter() - start)
        del model
    return {"call_s": call_s, "read_s": read_s, "page_cache": cache, "resident_before": held,
            "load_average": load_average()}


def timed_from_pretrained(directory: Path, cache: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.pretrained_load", "--time-from-pretrained", str(directory),
           "--page-cache", cache]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- one 2-rank launch of osdp-train ------------------------------------------------------------------
def train(overrides: list[str], work: Path, label: str, timeout_s: float, mmap: bool = False,
          cache: str = "") -> dict[str, Any]:
    """osdp-train with ``overrides`` on 2 ranks, the weight files put in ``cache`` state before a load;
    its records (:func:`report.read_run`)."""
    run_dir = work / label
    cmd = [sys.executable, "-m", "benchmarks.pretrained_load_worker", *SMOKE, *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OSDP_LIGHTNING_CACHE_DIR": str(work / "calibration"),
           worker.PAGE_CACHE_ENV: cache, **(MMAP_ENV if mmap else {})}
    start = time.perf_counter()
    code = run_ranks(cmd, work / f"{label}.log", timeout_s, env=env, cwd=ROOT)
    record = report.read_run(run_dir, (work / f"{label}.log").read_text(), code)
    record.update(label=label, overrides=list(overrides), wall_s=round(time.perf_counter() - start, 1),
                  load_average=load_average())
    print(report.progress_line(record), flush=True)
    Progress.write()
    return record


# -- the parts ---------------------------------------------------------------------------------
def saved_model(args: argparse.Namespace, work: Path, saved: dict[str, Any]) -> Path:
    """The 110M model, written into ``work`` once (its record into ``saved``)."""
    pretrained, record = work / "llama110m", work / "llama110m.json"
    if not record.exists():
        record.write_text(json.dumps(save_model("hf_llama_110m", args.model_overrides.split(), pretrained, seed=0)))
    saved["model"] = json.loads(record.read_text())
    return pretrained


def load_part(args: argparse.Namespace, work: Path, export: bool, saved: dict[str, Any]) -> None:
    """The 110M model into ``saved``: from_pretrained timings, osdp launches, the eager and ddp launches,
    the fixed costs."""
    pretrained = saved_model(args, work, saved)
    base = ["model=hf_llama_110m", f"model.pretrained={pretrained}", f"data.seq_len={args.seq_len}",
            f"trainer.max_steps={args.steps}"]
    budget = f"cluster.memory_budget={args.budget}"
    shown = [o.replace(str(pretrained), "DIR") for o in base]
    saved["command"] = " ".join(["MALLOC_MMAP_THRESHOLD_=65536 ./dev train", *shown, "meta_init=true", budget, *SMOKE])
    if args.probe_budget:
        saved["probe"] = train([*base, "meta_init=true", f"cluster.memory_budget={args.probe_budget}"], work,
                               "probe", args.run_timeout_s, mmap=True)
    saved["from_pretrained"], saved["osdp"] = [], []
    plan = [f"strategy.plan={work / 'osdp_0' / 'plan.json'}"]
    launches = [(f"osdp_{i}", "warm", plan if i else []) for i in range(args.repeats)]
    launches += [] if args.no_cold else [("osdp_cold", "cold", plan)]
    for label, cache, from_plan in launches:
        saved["from_pretrained"].append(timed_from_pretrained(pretrained, cache))
        ckpt = list(CHECKPOINT) if export and label == f"osdp_{args.repeats - 1}" else []
        record = train([*base, "meta_init=true", budget, *from_plan, *ckpt], work, label, args.run_timeout_s,
                       mmap=True, cache=cache)
        saved["osdp"].append({**record, "fixed_kind": "plan" if from_plan else "solve", "checkpoint": bool(ckpt)})
        if record["status"] != "ok":
            break
    solved = saved["osdp"][0]
    if solved["status"] == "ok":
        saved["eager"] = {**train([*base, budget, *plan], work, "eager", args.run_timeout_s, mmap=True),
                          "fixed_kind": "plan"}
    if not args.no_ddp:
        saved["ddp"] = {**train([*base, "strategy=ddp"], work, "ddp", args.run_timeout_s, mmap=True), "fixed_kind": "ddp"}
    budget_bytes = (solved.get("summary") or {}).get("memory_budget_bytes")
    saved["fixed"] = {}
    fixed_costs(args, work, f"{budget_bytes}B" if budget_bytes else args.budget, args.seq_len, saved["fixed"],
                with_plan=True, with_ddp=not args.no_ddp)


def long_part(args: argparse.Namespace, work: Path, saved: dict[str, Any]) -> None:
    """The 110M model at ``--long-seq-len`` and ``--long-budget``, built on meta and loaded; its fixed cost."""
    pretrained = saved_model(args, work, saved)
    overrides = ["model=hf_llama_110m", f"model.pretrained={pretrained}", f"data.seq_len={args.long_seq_len}",
                 f"trainer.max_steps={args.long_steps}", "meta_init=true", f"cluster.memory_budget={args.long_budget}"]
    saved["command"] = " ".join(["MALLOC_MMAP_THRESHOLD_=65536 ./dev train",
                                 *(o.replace(str(pretrained), "DIR") for o in overrides), *SMOKE])
    record = train(overrides, work, "long", args.run_timeout_s, mmap=True)
    saved["osdp"] = [{**record, "fixed_kind": "solve"}]
    budget_bytes = (record.get("summary") or {}).get("memory_budget_bytes")
    saved["fixed"] = {}
    if record["status"] == "ok":
        fixed_costs(args, work, f"{budget_bytes}B", args.long_seq_len, saved["fixed"], with_plan=False,
                    with_ddp=False, steps=args.long_steps)


def fixed_costs(args: argparse.Namespace, work: Path, budget: str, seq_len: int, fixed: dict[str, dict[str, Any]],
                with_plan: bool, with_ddp: bool, steps: int | None = None) -> None:
    """A 1 x 16 Llama through each command the 110M model ran: solving, from a saved plan, Lightning's ddp."""
    tiny = work / "tiny"
    if not tiny.exists():
        save_model("hf_llama_110m", list(TINY_LLAMA), tiny, seed=0)
    base = ["model=hf_llama_110m", f"model.pretrained={tiny}", f"data.seq_len={seq_len}",
            f"trainer.max_steps={steps or args.steps}"]
    meta = [*base, "meta_init=true", f"cluster.memory_budget={budget}"]
    label = f"fixed_{seq_len}"
    fixed["solve"] = train(meta, work, f"{label}_solve", args.run_timeout_s, mmap=True)
    if with_plan:
        fixed["plan"] = train([*meta, f"strategy.plan={work / f'{label}_solve' / 'plan.json'}"], work,
                              f"{label}_plan", args.run_timeout_s, mmap=True)
    if with_ddp:
        fixed["ddp"] = train([*base, "strategy=ddp"], work, f"{label}_ddp", args.run_timeout_s, mmap=True)


def matrix_part(args: argparse.Namespace, work: Path, records: list[dict[str, Any]]) -> None:
    """Per (family, shape), into ``records``: the probe, ddp, then osdp at two budgets x three ways of building."""
    for family, batch, seq in args.matrix_list:
        model, case = FAMILIES[family], f"{family} {batch}x{seq}"
        pretrained = work / f"{family}_pretrained"
        if not pretrained.exists():
            save_model(model, [], pretrained, seed=3)
        common = [f"model={model}", f"trainer.max_steps={args.matrix_steps}", f"data.batch_size={batch}",
                  f"data.seq_len={seq}"]
        from_dir = f"model.pretrained={pretrained}"
        jobs: list[tuple[str, list[str]]] = [
            ("probe", ["meta_init=true", from_dir, f"cluster.memory_budget={PROBE_BUDGET}"]),
            ("ddp", ["strategy=ddp", from_dir])]
        for i, (label, overrides) in enumerate(jobs):
            slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{case} {label}")
            record = train([*common, *overrides], work, slug, args.run_timeout_s)
            record.update(family=family, case=case, run=label)
            records.append(record)
            Progress.write()
            if i == 0:
                jobs += matrix_jobs(record.get("smallest_feasible_bytes"), from_dir, f"+strategy.pretrained={pretrained}")


def parse_matrix(text: str) -> list[tuple[str, int, int]]:
    """``"llama:2x64,gpt2:2x64"`` -> ``[("llama", 2, 64), ("gpt2", 2, 64)]`` (family: batch x seq_len)."""
    cases = []
    for item in filter(None, text.split(",")):
        family, _, shape = item.partition(":")
        batch, _, seq = shape.partition("x")
        if family not in FAMILIES or not (batch.isdigit() and seq.isdigit()):
            raise SystemExit(f"--matrix takes FAMILY:BATCHxSEQ items ({', '.join(FAMILIES)}); got {item!r}")
        cases.append((family, int(batch), int(seq)))
    return cases


def matrix_jobs(smallest: int | None, from_dir: str, strategy_loads: str) -> list[tuple[str, list[str]]]:
    """osdp at 60%ddp and 5% above the smallest budget: on meta, eager + osdp loads, eager from_pretrained."""
    budgets = [(SHARE_BUDGET, SHARE_BUDGET)]
    if smallest is not None:
        budgets.append((f"{int(smallest * ABOVE_SMALLEST)}B", f"+{round(100 * (ABOVE_SMALLEST - 1))}%"))
    builds = [("meta", ["meta_init=true", from_dir]), ("eager-load", [strategy_loads]),
              ("eager-from_pretrained", [from_dir])]
    return [(f"osdp {name} {build}", [f"cluster.memory_budget={budget}", *extra])
            for budget, name in budgets for build, extra in builds]


def export_part(load: dict[str, Any], work: Path) -> dict[str, Any]:
    """osdp-export of the last load launch's checkpoint, timed; from_pretrained of it against the checkpoint."""
    last = next((r for r in load["osdp"] if r.get("checkpoint")), load["osdp"][-1])
    ckpts = sorted((work / last["label"]).rglob("*.ckpt"))
    if last["status"] != "ok" or not ckpts:
        return {"status": "skipped", "message": f"no checkpoint from {last['label']} ({last['status']})"}
    out = work / "export"
    cmd = [sys.executable, "-m", "osdp_lightning.cli.export", str(ckpts[-1]), str(out), "--config",
           load["model"]["dir"]]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    record: dict[str, Any] = {"command": " ".join(["osdp-export", "CKPT", "OUT", "--config", "DIR"]),
                              "wall_s": time.perf_counter() - start, "returncode": done.returncode,
                              "stdout": done.stdout[-2000:], "load_average": load_average()}
    if done.returncode:
        record.update(status="error", message=done.stderr[-3000:])
        return record
    record.update(status="ok", file_bytes=sum(f.stat().st_size for f in out.glob("*.safetensors")),
                  checkpoint_bytes=sum(f.stat().st_size for f in ckpts[-1].rglob("*") if f.is_file()),
                  **compare_export(ckpts[-1], out))
    print(f"export: {record['wall_s']:.1f} s, {record['file_bytes']} bytes; bit for bit: {record['equal']}", flush=True)
    return record


def compare_export(checkpoint: Path, out: Path) -> dict[str, Any]:
    import torch
    import transformers

    from osdp_lightning.state.checkpoint import load_model_weights

    trained = {k.removeprefix("net."): v for k, v in load_model_weights(checkpoint).items()}
    start = time.perf_counter()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).state_dict()
    from_pretrained_s = time.perf_counter() - start
    differ = sorted(k for k, v in exported.items() if k not in trained or not torch.equal(v, trained[k]))
    return {"equal": not differ and set(exported) == set(trained), "differ": differ[:5],
            "tensors": len(exported), "from_pretrained_s": from_pretrained_s}


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.part_list = [p for p in args.parts.split(",") if p]
    args.matrix_list = parse_matrix(args.matrix)
    if set(args.part_list) - {"load", "long", "matrix", "export"}:
        raise SystemExit(f"--parts takes load, long, export, matrix; got {args.parts!r}")
    if "export" in args.part_list and "load" not in args.part_list:
        raise SystemExit("--parts export needs load (it exports the load part's checkpoint)")
    if min(args.steps, args.long_steps) < 3:
        raise SystemExit("--steps and --long-steps must be at least 3 (memory is tracked at step 2)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.time_from_pretrained is not None:
        print(json.dumps(time_from_pretrained(args.time_from_pretrained, args.page_cache)))
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.report_only is not None:
        print(report.write_outputs(args.out_dir, read_runs(args.report_only)))
        return 0
    start, load_start = time.perf_counter(), load_average()
    print(f"pretrained_load: parts {args.parts}; load average {load_start}", flush=True)
    machine = describe_machine(argparse.Namespace(accelerator="cpu", devices=2, rounds=args.repeats),
                               {"seq_len": args.seq_len, "steps": args.steps}, None)
    machine.update(command=" ".join(["./dev bench pretrained_load", *(argv if argv is not None else sys.argv[1:])]),
                   load_average_start=load_start, complete=False)
    saved: dict[str, Any] = {"load": None, "long": None, "matrix": [], "export": None, "machine": machine}
    Progress.saved, Progress.path = saved, args.out_dir / "pretrained_load_runs.json"
    with tempfile.TemporaryDirectory(prefix="osdp-pretrained-load-") as tmp:
        work = Path(tmp)
        if "load" in args.part_list:
            saved["load"] = {}
            load_part(args, work, "export" in args.part_list, saved["load"])
        if "export" in args.part_list:
            saved["export"] = export_part(saved["load"], work)
            Progress.write()
        if "long" in args.part_list:
            saved["long"] = {}
            long_part(args, work, saved["long"])
            Progress.write()
        if "matrix" in args.part_list:
            matrix_part(args, work, saved["matrix"])
    machine.update(load_average_end=load_average(), total_wall_s=round(time.perf_counter() - start, 1), complete=True)
    print(report.write_outputs(args.out_dir, saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
