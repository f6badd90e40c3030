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
from pathlib import Path
from typing import Optional, Sequence

from vllm_nvfp4.evaluation.kv_configs import DEFAULT_CONFIGS
from vllm_nvfp4.testing.assets import assets_dir

PASSKEY_TRIALS = 5  # default prompts; depths: passkey.spread_depths (0.1, 0.3, ..., 0.9)


def _default_asset(name: str) -> Optional[Path]:
    p = assets_dir() / name
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
    ap.add_argument("--passkey-trials", type=int, default=PASSKEY_TRIALS,
                    help=f"passkey prompts, depths spread over 0.1..0.9 (0: skip; default {PASSKEY_TRIALS})")
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
