"""Command line of ``python -m benchmarks.e2e`` (the flags are described in the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

import benchmarks.e2e as package
from benchmarks.e2e.configs import CONFIGS, parse_contexts, parse_dtypes
from vllm_nvfp4.testing.weightless import PRESETS

DEFAULT_TARGETS = Path(__file__).resolve().parent / "targets.toml"


def _list(text: str) -> list[str]:
    return [p for p in text.split(",") if p]


def existing_files(text: str) -> list[str]:
    """Comma-separated paths, each an existing file (a mistyped ``--prior-records`` would
    otherwise merge nothing, silently)."""
    paths = _list(text)
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise ValueError(f"no such file: {', '.join(missing)} (earlier runs' records files)")
    return paths


def _checked(parse):
    """An argparse ``type`` that shows ``parse``'s ValueError message."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


DTYPES, CONTEXTS = _checked(parse_dtypes), _checked(parse_contexts)


def _engine_args(text: str) -> dict:
    """``--engine-args``: a JSON object of ``LLM()`` keyword arguments."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--engine-args must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--engine-args must be a JSON object, got {type(value).__name__}")
    per_config = sorted(set(value) & {"model", "kv_cache_dtype", "attention_backend"})
    if per_config:
        raise ValueError(f"--engine-args cannot set {per_config}: each configuration sets them "
                         "(use --model and --dtypes)")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=package.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("run")
    g.add_argument("--out", default=None, help="result folder (records, summary, logs); required")
    g.add_argument("--dtypes", type=DTYPES, default=parse_dtypes("fp8,nvfp4-mixed,auto"),
                   help=f"configurations in order, 'all' or 'none' ({', '.join(CONFIGS)})")
    g.add_argument("--contexts", type=CONTEXTS, default=parse_contexts("32768,8192"),
                   help="prompt lengths in tokens ('32k' ok) for TTFT and decode")
    g.add_argument("--ttft-contexts", type=CONTEXTS, default=[],
                   help="extra prompt lengths measured for TTFT only")
    g.add_argument("--prior-records", type=_checked(existing_files), default=[],
                   help="e2e_records.jsonl files of earlier runs (comma-separated): merged into the "
                        "summary; fp8's largest batches come from them when fp8 is not run now")
    g.add_argument("--targets", default=str(DEFAULT_TARGETS),
                   help="TOML file of ratio targets to check ('none': no check)")
    g.add_argument("--fresh", action="store_true", help="delete earlier records in --out first")
    g.add_argument("--dry-run", action="store_true", help="print the plan (model, bytes per token, "
                   "commands) as JSON and exit without starting an engine")
    g = ap.add_argument_group("model and engine")
    g.add_argument("--model", default=None, help="model dir (default: written from --preset)")
    g.add_argument("--model-dir", default=None,
                   help="where --preset's model is written (default /tmp/vllm-nvfp4-models/PRESET-random)")
    g.add_argument("--preset", choices=sorted(PRESETS), default="llama8b")
    g.add_argument("--mixed-policy", default=None, help="policy of nvfp4-mixed, compact or a JSON file "
                   "(e.g. of benchmarks/synthetic_rot_policy.py; default: "
                   "dense models the first eighth of the layers FP8; hybrid models the default rule "
                   "of vllm_nvfp4.policy: sliding FP8, first/last full-attention FP8, rest NVFP4)")
    g.add_argument("--gpu-mem", type=float, default=0.9, help="gpu_memory_utilization (same for all)")
    g.add_argument("--max-model-len", type=int, default=None, help="default: largest context + headroom")
    g.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: vLLM's (16384 for LLM() on an H100/H200: what --dry-run assumes)")
    g.add_argument("--max-batch", type=int, default=512, help="cap of the largest batch (graph sizes)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: vLLM's)")
    g.add_argument("--extensible-kv-cache", choices=("on", "off"), default=None,
                   help="vLLM >= 0.34: size the KV cache after CUDA-graph capture (VMM) or from the "
                        "profiling estimate (default: vLLM's, on for CUDA)")
    g.add_argument("--engine-args", type=_checked(_engine_args), default={},
                   help="more LLM() arguments of the offline runs (every configuration), a JSON object (e.g. "
                        "'{\"async_scheduling\": false}' or '{\"cudagraph_metrics\": true, "
                        "\"disable_log_stats\": false}'); they override the ones set here")
    g.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs; not for numbers)")
    g.add_argument("--default-capture-sizes", action="store_true", help="vLLM's own CUDA-graph sizes")
    g.add_argument("--cpu", action="store_true", help="CPU build of vLLM: no backend names, no nvidia-smi")
    g.add_argument("--cpu-tiny", action="store_true",
                   help="CPU smoke run: tiny model, context 64, 4 steps, eager, auto + nvfp4-mixed")
    g = ap.add_argument_group("decode and TTFT")
    g.add_argument("--headroom", type=int, default=1024, help="tokens kept per sequence beyond the prompt")
    g.add_argument("--steps", type=int, default=64, help="timed decode steps per stage")
    g.add_argument("--warm-steps", type=int, default=8, help="decode steps before the timed ones")
    g.add_argument("--ttft-reps", type=int, default=3, help="TTFT requests per context (median)")
    g.add_argument("--profile", action="store_true", help="kernel split of decode at the reference batch")
    g.add_argument("--profile-steps", type=int, default=5)
    g.add_argument("--profile-dir", default="/tmp/vllm-nvfp4-profile")
    g = ap.add_argument_group("serving (vllm serve + vllm bench serve)")
    g.add_argument("--serve", type=DTYPES, default=[], help="configurations to serve after the "
                   "offline runs ('none')")
    g.add_argument("--serve-prompt-len", type=int, default=2048, help="--random-input-len")
    g.add_argument("--serve-output-len", type=int, default=128, help="--random-output-len")
    g.add_argument("--serve-requests", type=int, default=128, help="--num-prompts")
    g.add_argument("--clients", type=int, default=32, help="--max-concurrency")
    g.add_argument("--request-rate", default="inf", help="--request-rate (requests/s; inf: all at once)")
    g.add_argument("--bench-serve-args", default="", help="more `vllm bench serve` arguments (one string)")
    g.add_argument("--port", type=int, default=8123)
    g.add_argument("--serve-start-s", type=float, default=900.0,
                   help="give up on a server whose /health has not answered after this long")
    g = ap.add_argument_group("time budget (optional)")
    g.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the whole run; "
                   "without it nothing is skipped or killed")
    g.add_argument("--prefill-factor", type=float, default=1.1,
                   help="prefill time per request = factor x TTFT, for the stage estimates")
    g.add_argument("--serve-reserve-s", type=float, default=150.0, help="budget kept for the serve runs")
    g.add_argument("--serve-min-s", type=float, default=120.0, help="skip a serve run with less left")
    g.add_argument("--min-config-s", type=float, default=100.0,
                   help="time kept for each later configuration (engine start + TTFT)")
    g.add_argument("--grace-s", type=float, default=20.0, help="after a worker's deadline, before the kill")
    g = ap.add_argument_group("plots")
    g.add_argument("--plot", default=None, metavar="SUMMARY_JSON",
                   help="only plot an earlier summary into --plot-dir, then exit")
    g.add_argument("--plot-dir", default=None, help="default: the summary's folder")
    return ap


CPU_TINY = dict(preset="tiny", contexts=[64], steps=4, warm_steps=1, ttft_reps=1, headroom=64,
                max_batch=8, min_config_s=10.0, serve_reserve_s=60.0, serve_min_s=20.0, clients=2,
                serve_requests=4, serve_prompt_len=32, serve_output_len=8,
                dtypes=["auto", "nvfp4-mixed"])


def parse_common(ap: argparse.ArgumentParser, argv: Optional[list[str]],
                 cpu_tiny: dict) -> argparse.Namespace:
    """Parse ``argv`` with ``ap`` and apply what both benchmark CLIs share: ``--out`` required
    (unless ``--plot``), ``--cpu-tiny``'s defaults (``cpu_tiny``; flags given explicitly win),
    and the CPU build's KV space and memory fraction."""
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)
    a.argv = argv
    if a.plot:
        return a
    if not a.out:
        ap.error("--out is required")
    if a.cpu_tiny:
        given = {t.split("=")[0] for t in argv if t.startswith("--")}
        for k, v in cpu_tiny.items():
            if "--" + k.replace("_", "-") not in given:
                setattr(a, k, v)
        a.cpu = a.eager = True
    if a.cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU worker needs a size
        if not any(t.startswith("--gpu-mem") for t in argv):
            a.gpu_mem = 0.3  # on CPU: the fraction of RAM vLLM checks is free
    return a


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = build_parser()
    a = parse_common(ap, argv, CPU_TINY)
    if a.plot:
        return a
    a.targets = None if a.targets in ("", "none") else a.targets
    if a.model_dir is None:
        a.model_dir = f"/tmp/vllm-nvfp4-models/{a.preset}-random"
    longest = max(a.contexts + a.ttft_contexts)
    if a.max_model_len is None:
        a.max_model_len = longest + a.headroom
    if longest + a.headroom > a.max_model_len:
        ap.error(f"--max-model-len {a.max_model_len} < largest context + headroom "
                 f"({longest} + {a.headroom})")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    if a.plot:
        from benchmarks.e2e.plots import plot_summary

        for p in plot_summary(Path(a.plot), Path(a.plot_dir or Path(a.plot).parent)):
            print(p)
        return 0
    from benchmarks.e2e import orchestrate

    if a.dry_run:
        orchestrate.prepare_model(a)
        print(json.dumps(orchestrate.plan(a), indent=1))
        return 0
    return orchestrate.run(a)
