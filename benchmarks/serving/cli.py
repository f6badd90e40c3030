"""Command line of ``python -m benchmarks.serving`` (the package docstring describes the run)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import benchmarks.serving as package
from benchmarks.e2e.cli import DTYPES, _checked, existing_files, parse_common
from benchmarks.e2e.configs import CONFIGS, parse_dtypes
from benchmarks.serving.workloads import WORKLOADS, longest_request, parse_ints, parse_range, parse_tokens
from vllm_nvfp4.testing.weightless import PRESETS


def parse_workloads(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise ValueError(f"workloads must be some of {list(WORKLOADS)}, got {text!r}")
    return names


def parse_rate(text: str) -> float:
    r = float(text)
    if not r > 0:
        raise ValueError(f"a request rate must be > 0 requests/s, got {text!r}")
    return r


RANGE, INTS, TOKENS = _checked(parse_range), _checked(parse_ints), _checked(parse_tokens)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=package.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("run")
    g.add_argument("--out", default=None, help="result folder; required")
    g.add_argument("--configs", type=DTYPES, default=parse_dtypes("fp8,nvfp4-mixed,nvfp4"),
                   help=f"configurations in order (from benchmarks/e2e/configs.py: {', '.join(CONFIGS)})")
    g.add_argument("--workloads", type=_checked(parse_workloads), default=list(WORKLOADS),
                   help=f"some of {','.join(WORKLOADS)}, run in this order on each server")
    g.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of the whole run: runs that would not fit are skipped and "
                        "recorded, a client past its configuration's deadline is killed")
    g.add_argument("--prior-records", type=_checked(existing_files), default=[], help="serving_records.jsonl files of earlier runs "
                   "(comma-separated), merged into the summary (a run measured again replaces them)")
    g.add_argument("--skip-measured", action="store_true",
                   help="leave out the runs (configuration and label) --prior-records already hold "
                        "a result of, and a server none of whose runs is left (a rate search "
                        "resumes from its earlier probes either way)")
    g.add_argument("--fresh", action="store_true", help="delete earlier records in --out first")
    g.add_argument("--dry-run", action="store_true", help="print the server and client commands and exit")
    g.add_argument("--plot", default=None, metavar="SUMMARY_JSON", help="only plot a summary, then exit")
    g.add_argument("--merge-only", action="store_true",
                   help="serve nothing: write --out's summary, table and plots from --prior-records "
                        "alone (runs measured apart, one rate search over all their probes)")
    g = ap.add_argument_group("model and server (`vllm serve`)")
    g.add_argument("--model", default=None, help="model dir (default: the weight-less --preset)")
    g.add_argument("--model-dir", default=None, help="where --preset's model is written")
    g.add_argument("--preset", choices=sorted(PRESETS), default="llama8b")
    g.add_argument("--mixed-policy", default=None, help="compact policy of nvfp4-mixed (default: "
                   "benchmarks/e2e/configs.py's: the first eighth of the layers FP8)")
    g.add_argument("--gpu-mem", type=float, default=0.9, help="--gpu-memory-utilization (all configs)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest request of the selected workloads + 256")
    g.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    g.add_argument("--eager", action="store_true", help="--enforce-eager (no CUDA graphs; not for numbers)")
    g.add_argument("--cpu", action="store_true", help="CPU build of vLLM: no backend names")
    g.add_argument("--port", type=int, default=8123)
    g.add_argument("--serve-start-s", type=float, default=600.0, help="give up on /health after this long")
    g.add_argument("--bench-serve-args", default="", help="more `vllm bench serve` arguments (one string)")
    g.add_argument("--cpu-tiny", action="store_true", help="CPU smoke run: tiny model and lengths, "
                   "auto + nvfp4-mixed, eager")
    g = ap.add_argument_group("workloads")
    g.add_argument("--chat-input", type=RANGE, default=parse_range("16k-32k"), help="prompt tokens, lo-hi")
    g.add_argument("--chat-output", type=RANGE, default=parse_range("256-1024"), help="output tokens, lo-hi")
    g.add_argument("--chat-concurrency", type=INTS, default=parse_ints("16,64,128,256"),
                   help="--max-concurrency levels of the chat workload")
    g.add_argument("--prompts-per-client", type=float, default=1.0,
                   help="prompts per run = this x concurrency (at least --min-prompts)")
    g.add_argument("--min-prompts", type=int, default=16)
    g.add_argument("--prefix-lens", type=_checked(lambda t: [parse_tokens(x) for x in t.split(",")]),
                   default=[8192, 16384], help="shared prefix lengths (one run each)")
    g.add_argument("--prefix-suffix-len", type=TOKENS, default=1024, help="own tokens after the prefix")
    g.add_argument("--prefix-num-prefixes", type=int, default=8, help="distinct prefixes per run")
    g.add_argument("--prefix-output-len", type=TOKENS, default=512)
    g.add_argument("--prefix-concurrency", type=INTS, default=parse_ints("64,128"))
    g = ap.add_argument_group("rate search (highest request rate within the objective)")
    g.add_argument("--tpot-p99-ms", type=float, default=50.0, help="objective: p99 TPOT (ms)")
    g.add_argument("--ttft-p99-ms", type=float, default=None, help="optional objective: p99 TTFT (ms)")
    g.add_argument("--rate-start", type=_checked(parse_rate), default=0.5, help="first probe (requests/s)")
    g.add_argument("--rate-factor", type=float, default=2.0, help="bracket widening factor")
    g.add_argument("--rate-tol", type=float, default=0.15, help="stop when high / low <= 1 + tol")
    g.add_argument("--max-probes", type=int, default=5, help="probes in this call (a search "
                   "resumes from the probes in --prior-records made with the same objective)")
    g.add_argument("--probe-s", type=float, default=90.0, help="seconds of Poisson arrivals per probe")
    g = ap.add_argument_group("time estimates (for --budget-s; corrected by each measured run)")
    g.add_argument("--est-prefill-tok-s", type=float, default=30000.0, help="prompt tokens/s")
    g.add_argument("--est-decode-tok-s", type=float, default=2000.0, help="output tokens/s")
    g.add_argument("--min-config-s", type=float, default=150.0,
                   help="time kept for each later configuration (server start + one run)")
    return ap


CPU_TINY = dict(preset="tiny", configs=["auto", "nvfp4-mixed"], chat_input=parse_range("32-64"),
                chat_output=parse_range("4-8"), chat_concurrency=[2, 4], min_prompts=4,
                prefix_lens=[64], prefix_suffix_len=16, prefix_num_prefixes=2, prefix_output_len=4,
                prefix_concurrency=[4], rate_start=4.0, max_probes=2, probe_s=2.0, tpot_p99_ms=2000.0,
                est_prefill_tok_s=500.0, est_decode_tok_s=20.0, min_config_s=40.0, serve_start_s=420.0)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = build_parser()
    a = parse_common(ap, argv, CPU_TINY)
    if a.plot:
        return a
    if a.merge_only:
        if not a.prior_records:
            ap.error("--merge-only writes a summary of --prior-records: name the serving_records.jsonl files")
        a.out = str(Path(a.out))
        return a
    if not a.configs:
        ap.error("--configs is empty")
    if a.prefix_num_prefixes <= 0 or a.max_probes <= 0 or a.probe_s <= 0 or a.min_prompts <= 0:
        ap.error("--prefix-num-prefixes, --max-probes, --probe-s and --min-prompts must be positive")
    if a.model_dir is None:
        a.model_dir = f"/tmp/vllm-nvfp4-models/{a.preset}-random"
    need = longest_request(a)
    if a.max_model_len is None:
        a.max_model_len = need + 256  # vLLM's random prompts may re-tokenize a few tokens longer
    elif a.max_model_len < need:
        ap.error(f"--max-model-len {a.max_model_len} < the longest request of the workloads ({need})")
    if a.skip_measured and not a.prior_records:
        ap.error("--skip-measured leaves out what --prior-records holds: name the earlier "
                 "serving_records.jsonl with --prior-records")
    a.out = str(Path(a.out))
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    if a.plot:
        from benchmarks.serving.plots import plot_summary

        for p in plot_summary(Path(a.plot), Path(a.plot).parent):
            print(p)
        return 0
    from benchmarks.serving import orchestrate

    if a.merge_only:
        return orchestrate.merge_only(a)
    return orchestrate.dry_run(a) if a.dry_run else orchestrate.run(a)
