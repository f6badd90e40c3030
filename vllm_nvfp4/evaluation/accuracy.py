"""Accuracy of KV-cache configurations through vLLM: every configuration's engine, then GSM8K, then
the paired comparisons, written as ``results.json``, ``results.md`` and ``accuracy.png``. The
command line and what it reports: :mod:`.accuracy_args` (``scripts/eval_accuracy.py``)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

from vllm_nvfp4.evaluation import gsm8k, passkey
from vllm_nvfp4.evaluation.accuracy_args import parse_args
from vllm_nvfp4.evaluation.accuracy_runs import kv_bytes, log, run_engine, run_gsm8k, versions
from vllm_nvfp4.evaluation.engine import CPU_ENV_DEFAULTS, EngineFailed, EngineJob
from vllm_nvfp4.evaluation.kv_configs import OURS, ConfigError, build_configs
from vllm_nvfp4.evaluation.logprobs import WindowScores, compare, ratio_to
from vllm_nvfp4.evaluation.report import FP8_REFERENCES, check_targets, markdown_table, plot, targets_markdown
from vllm_nvfp4.evaluation.windows import tail_windows
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.policy import KVPolicy, PolicyError

DEFAULT_KV_SPACE_GIB = "1"


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
    depths = passkey.spread_depths(args.passkey_trials)
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
        if cfg.zero_config and "policy" in er:  # the formats the start-up calibration chose
            cfg = replace(cfg, policy=KVPolicy.from_dict(er["policy"]))
            r.update(cfg.summary(shape), startup_policy=er["policy"])
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

