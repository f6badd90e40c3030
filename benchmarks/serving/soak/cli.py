"""Command line and run of ``python -m benchmarks.serving.soak`` (see the package docstring)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import shlex
import subprocess
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path
from typing import Optional

import benchmarks.serving.soak as package
from benchmarks.e2e.cli import DTYPES, _checked
from benchmarks.e2e.configs import CONFIGS, parse_dtypes, policy_for, unavailable_reason
from benchmarks.e2e.orchestrate import child_env, kill_group, versions, wait_gpu_free
from benchmarks.e2e.records import Recorder, read_records
from benchmarks.e2e.worker import log
from benchmarks.serving.cli import RANGE
from benchmarks.serving.soak import compare, worker
from benchmarks.serving.soak.requests import SoakParams, make_requests
from benchmarks.serving.workloads import parse_range
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.testing.weightless import PRESETS, build_weightless_model

SUMMARY, TABLE = "soak_summary.json", "soak_summary.md"
#: no pass is started with less of the budget left: an engine start (60-120 s) plus serving time
MIN_PASS_S = 150.0


def parse_modes(text: str) -> list[str]:
    modes = [t.strip() for t in text.split(",") if t.strip()]
    if not modes or any(m not in worker.MODES for m in modes):
        raise ValueError(f"passes must be some of {list(worker.MODES)}, got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving.soak", description=package.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("run")
    g.add_argument("--out", required=True, help="result folder (outputs, records, summary)")
    g.add_argument("--configs", type=DTYPES, default=parse_dtypes("nvfp4-mixed,fp8"),
                   help=f"configurations (benchmarks/e2e/configs.py: {', '.join(CONFIGS)})")
    g.add_argument("--passes", type=_checked(parse_modes), default=list(worker.MODES),
                   help="passes per configuration, in order (pressure, spec, alone); outputs already "
                        "in --out are kept and not served again")
    g.add_argument("--budget-s", type=float, default=None, help="wall-clock budget: passes run in order "
                   "until it ends; the one running then stops submitting (a later call resumes it), "
                   "a stuck one is killed")
    g.add_argument("--fresh", action="store_true", help="delete earlier outputs and records in --out")
    g.add_argument("--compare-only", action="store_true", help="only compare the outputs in --out")
    g = ap.add_argument_group("requests (the same set for every configuration and pass)")
    g.add_argument("--requests", type=int, default=1000)
    g.add_argument("--prompt-len", type=RANGE, default=parse_range("1-32k"))
    g.add_argument("--uniform", action="store_true", help="prompt lengths uniform (default: log-uniform)")
    g.add_argument("--output-len", type=RANGE, default=parse_range("8-64"))
    g.add_argument("--prefix-fraction", type=float, default=0.3, help="share of requests with a shared prefix")
    g.add_argument("--prefix-len", type=RANGE, default=parse_range("1k-8k"))
    g.add_argument("--num-prefixes", type=int, default=8)
    g.add_argument("--spec-fraction", type=float, default=0.2, help="share served with ngram speculation")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("engines")
    g.add_argument("--model", default=None, help="a checkpoint dir (its weights); default: --preset "
                   "weight-less, random weights")
    g.add_argument("--preset", choices=sorted(PRESETS), default="llama8b")
    g.add_argument("--model-dir", default=None, help="where --preset's model is written")
    g.add_argument("--mixed-policy", default=None, help="compact policy of nvfp4-mixed")
    g.add_argument("--pressure-kv-tokens", type=int, default=None,
                   help="KV tokens of the pressure and spec engines (default: 3 x max_model_len)")
    g.add_argument("--chunk-tokens", type=int, default=4096, help="max_num_batched_tokens (chunked prefill)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="pressure / spec engines")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--spec-tokens", type=int, default=3, help="ngram num_speculative_tokens")
    g.add_argument("--gpu-mem", type=float, default=0.9)
    g.add_argument("--tie-nats", type=float, default=0.05,
                   help="a mismatch where the alone pass's top-2 margin is below this is a near tie")
    g.add_argument("--eager", action="store_true")
    g.add_argument("--cpu", action="store_true")
    g.add_argument("--cpu-tiny", action="store_true", help="CPU smoke run: the tiny repetitive "
                   "Llama of vllm_nvfp4.testing.spec_models with its weights, short prompts, auto + nvfp4-mixed")
    return ap


CPU_TINY = dict(configs=["auto", "nvfp4-mixed"], requests=20, prompt_len=parse_range("1-160"),
                output_len=parse_range("8-24"), prefix_len=parse_range("32-96"), num_prefixes=3,
                spec_fraction=0.25, pressure_kv_tokens=256, chunk_tokens=64, max_num_seqs=16,
                block_size=32, gpu_mem=0.3)  # vLLM's CPU attention: blocks of 32n


def parse_args(argv: Optional[list[str]] = None) -> Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    a = ap.parse_args(argv)
    a.argv = argv
    if a.cpu_tiny:
        given = {t.split("=")[0] for t in argv if t.startswith("--")}
        for k, v in CPU_TINY.items():
            if "--" + k.replace("_", "-") not in given:
                setattr(a, k, v)
        a.cpu = a.eager = True
    if a.requests <= 0 or a.num_prefixes <= 0:
        ap.error("--requests and --num-prefixes must be positive")
    for name in ("prefix_fraction", "spec_fraction"):
        if not 0 <= getattr(a, name) <= 1:
            ap.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    a.max_model_len = a.prompt_len.hi + a.output_len.hi + a.spec_tokens + 16
    a.pressure_kv_tokens = a.pressure_kv_tokens or 3 * a.max_model_len
    if a.pressure_kv_tokens < a.max_model_len + a.block_size:  # vLLM keeps one block back
        ap.error(f"--pressure-kv-tokens {a.pressure_kv_tokens} < max_model_len {a.max_model_len} + "
                 f"one block ({a.block_size}): vLLM refuses a cache that cannot hold one request")
    return a


def prepare_model(a: Namespace) -> tuple[str, str]:
    """(model dir, load format): ``--model`` with its weights; else the weight-less preset (dummy
    weights), or on ``--cpu-tiny`` the tiny Llama with its weights."""
    if a.model:
        return a.model, "auto"
    if a.cpu_tiny:  # greedy text with repeated runs: ngram drafts hit and miss
        from vllm_nvfp4.testing.spec_models import repetitive_llama

        d = Path(a.model_dir or "/tmp/vllm-nvfp4-models/soak-tiny") / "repetitive"
        return str(d if (d / "model.safetensors").exists() else repetitive_llama(d)), "auto"
    d = a.model_dir or f"/tmp/vllm-nvfp4-models/{a.preset}-random"
    need = a.max_model_len + 1024
    return str(build_weightless_model(d, a.preset, need if need > PRESETS[a.preset]["max_pos"] else None)), "dummy"


def soak_params(a: Namespace, vocab: int) -> SoakParams:
    return SoakParams(a.requests, a.prompt_len, a.output_len, a.prefix_len, a.prefix_fraction,
                      a.num_prefixes, a.spec_fraction, vocab, a.seed, not a.uniform)


def vocab_size(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def pass_spec(a: Namespace, model: str, load_format: str, name: str, modes: list[str],
              deadline: float) -> dict:
    """The worker's spec: configuration ``name`` serving passes ``modes`` on one engine."""
    shape = ModelShape.from_model_dir(model)
    p = soak_params(a, vocab_size(model))
    return dict(out=str(Path(a.out).resolve()), config=name, modes=modes, model=model,
                load_format=load_format, max_model_len=a.max_model_len, gpu_mem=a.gpu_mem,
                chunk_tokens=a.chunk_tokens, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                pressure_kv_tokens=a.pressure_kv_tokens, spec_tokens=a.spec_tokens,
                eager=a.eager, cpu=a.cpu, hybrid=shape.needs_packed_groups,
                deadline=deadline, policy=policy_for(CONFIGS[name], shape.layer_types, a.mixed_policy),
                distributed_executor_backend="uni" if a.cpu else None,
                params=dict(vars(p), prompt=[p.prompt.lo, p.prompt.hi], output=[p.output.lo, p.output.hi],
                            prefix_len=[p.prefix_len.lo, p.prefix_len.hi]))


def run_worker(a: Namespace, spec: dict, grace_s: float = 60.0) -> Optional[int]:
    """The passes of ``spec`` in their own process (a fresh engine; GPU memory back when it
    exits). Its process group (the engine core too) is killed when it exits, or ``grace_s``
    after the deadline (the worker stops itself at the deadline)."""
    out = Path(a.out)
    label = "+".join(spec["modes"])
    path = out / f"pass_{spec['config']}_{label}.json"
    path.write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "benchmarks.serving.soak.worker", str(path)]
    with open(out / "soak_workers.log", "a") as lf:
        lf.write(f"\n===== {shlex.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env(), start_new_session=True, bufsize=1)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            kill_group(proc)

        timer = None if math.isinf(spec["deadline"]) else threading.Timer(
            max(30.0, spec["deadline"] - time.time() + grace_s), kill)
        def pump() -> None:  # the worker's output; ends when every process of the group is gone
            assert proc.stdout is not None
            for line in proc.stdout:
                lf.write(line)
                if line.startswith("[bench"):
                    sys.stdout.write(line)
                    sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        if timer:
            timer.start()
        proc.wait()
        if timer:
            timer.cancel()
        kill_group(proc)  # an engine core the worker left behind
        reader.join(timeout=30)
    if killed.is_set():
        Recorder(out / worker.RECORDS, config=spec["config"]).write(
            "killed", mode=label, reason="past its deadline")
        log(f"soak {spec['config']} {label}: past its deadline, killed")
    if not a.cpu:
        wait_gpu_free()
    return proc.returncode


def load_outputs(out: Path, name: str, mode: str) -> dict[int, dict]:
    return {r["id"]: r for r in read_records(worker.outputs_path(out, name, mode))}


def summarize(a: Namespace, model: str, head: dict) -> dict:
    out = Path(a.out)
    reqs = make_requests(soak_params(a, vocab_size(model)))
    records = read_records(out / worker.RECORDS)
    configs = {}
    for name in a.configs:
        alone = load_outputs(out, name, "alone")
        tested = {m: load_outputs(out, name, m) for m in ("pressure", "spec")}
        res = compare.compare(reqs, alone, {m: o for m, o in tested.items() if o}, a.tie_nats)
        passes = [r for r in records if r.get("config") == name and r["kind"] == "pass"]
        res["preemptions"] = {m: sum(r["preemptions"] for r in passes if r["mode"] == m)
                              for m in worker.MODES}  # the alone pass's must be 0
        res["drafted"] = sum(r["drafted"] for r in passes if r["mode"] == "spec")
        res["accepted"] = sum(r["accepted"] for r in passes if r["mode"] == "spec")
        res["crashes"] = [dict(mode=r.get("mode"), error=r.get("error"))
                          for r in records if r.get("config") == name and r["kind"] == "error"]
        res["killed"] = [r.get("mode") for r in records if r.get("config") == name and r["kind"] == "killed"]
        configs[name] = res
    summary = dict(head, finished_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   requests=dict(total=len(reqs), shared_prefix=sum(r.prefix >= 0 for r in reqs),
                                 spec=sum(r.spec for r in reqs),
                                 prompt_tokens=sum(len(r.prompt) for r in reqs),
                                 longest_prompt=max(len(r.prompt) for r in reqs)),
                   configs=configs, records=records)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1))
    (out / TABLE).write_text(markdown(summary))
    return summary


def markdown(summary: dict) -> str:
    rq = summary["requests"]
    lines = [f"Soak: {rq['total']} requests ({rq['shared_prefix']} with a shared prefix, {rq['spec']} "
             f"speculative; {rq['prompt_tokens']} prompt tokens, longest {rq['longest_prompt']}), each "
             "against the same request served alone", "",
             "| config | pass | compared | mismatched | near ties | with shared prefix | log-probs identical | "
             "max log-prob diff | bad outputs | missing | preemptions | drafts accepted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in summary["configs"].items():
        for mode in ("pressure", "spec"):
            if mode not in c:
                continue
            m = c[mode]
            acc = f"{c['accepted']:.0f} / {c['drafted']:.0f}" if mode == "spec" else "-"
            lines.append(f"| {name} | {mode} | {m['compared']} | {m['mismatched']} | {m['mismatched_near_tie']} "
                         f"| {m['mismatched_shared_prefix']} | {m['logprobs_identical']} | {m['max_logprob_diff']:.2g} "
                         f"| {len(m['bad_outputs'])} | {m['missing']} "
                         f"| {c['preemptions'][mode]:.0f} | {acc} |")
        for cr in c["crashes"]:
            lines.append(f"\n- {name} {cr['mode']}: CRASH {cr['error']}")
        for mode in c["killed"]:
            lines.append(f"\n- {name} {mode}: killed past its deadline (the next call resumes it)")
        if c["alone_bad_outputs"]:
            lines.append(f"\n- {name} alone: {len(c['alone_bad_outputs'])} bad outputs")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.fresh:
        for p in list(out.glob("outputs_*.jsonl")) + [out / worker.RECORDS]:
            p.unlink(missing_ok=True)
    model, load_format = prepare_model(a)
    head = dict(started_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                command=shlex.join([sys.executable, "-m", "benchmarks.serving.soak"] + a.argv),
                args={k: str(v) for k, v in vars(a).items() if k != "argv"}, versions=versions(),
                model=dict(path=model, load_format=load_format), method="benchmarks/serving/soak/__init__.py")
    end = time.time() + a.budget_s if a.budget_s else math.inf
    # every configuration's reference and pressure passes first, then the speculative ones
    groups = worker.engine_groups(a.passes)
    steps = [] if a.compare_only else [(n, g) for g in groups for n in a.configs]
    for name, modes in steps:
        mode = "+".join(modes)
        rec = Recorder(out / worker.RECORDS, config=name)
        why = unavailable_reason(CONFIGS[name])
        if why:
            rec.write("skip", mode=mode, reason=why)
            log(f"soak {name}: skipped ({why})")
            continue
        if end - time.time() < MIN_PASS_S:
            rec.write("skip", mode=mode, reason="budget")
            log(f"soak {name} {mode}: skipped (budget; the next call resumes it)")
            continue
        # passes run in order, each with all the budget left: a pass cut off resumes on the next
        # call, whereas a share smaller than an engine start would serve nothing
        deadline = end if math.isinf(end) else end - 30
        run_worker(a, pass_spec(a, model, load_format, name, modes, deadline))
        summarize(a, model, head)
    summary = summarize(a, model, head)
    print("\n" + (out / TABLE).read_text(), flush=True)
    log(f"soak summary in {out / SUMMARY}")
    return 0 if all(not c["crashes"] for c in summary["configs"].values()) else 1
