"""How far a last-bit change of K/V moves next-token predictions, per KV-cache configuration.

The measurement is :mod:`vllm_nvfp4.evaluation.rounding_sensitivity`: teacher-forced log-probs of
real text with the K/V projections in FP32, unperturbed and moved by at most ``--rel`` (relative)
before rounding to bf16, for an unquantized cache and for each given policy. Choose ``--rel`` so
that the unquantized row matches the decode-vs-prefill difference measured on a BF16 cache; the
quantized rows then show how much of their own decode-vs-prefill difference rounding alone
explains. Reported per configuration: argmax agreement of the two runs and the mean / max
|difference| of the text tokens' log-probs.

    python scripts/kv_rounding_sensitivity.py MODEL_DIR --data brown.txt --out DIR \
        [--window 1024] [--windows 2] [--policy NAME=policy.json ...] [--rel 2^-16] [--seed 0]

Writes ``DIR/kv_rounding_sensitivity.json`` and ``.md``; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional

from vllm_nvfp4.calibration.data import DataError, add_text_arguments, load_windows
from vllm_nvfp4.calibration.modeling import ModelError, load_model
from vllm_nvfp4.calibration.progress import progress
from vllm_nvfp4.evaluation.rounding_sensitivity import markdown, measure
from vllm_nvfp4.policy import KVPolicy, PolicyError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_text_arguments(ap, 1024, 2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rel", type=float, default=2.0 ** -16,
                    help="largest relative move of an FP32 K/V projection output (default 2^-16)")
    ap.add_argument("--policy", action="append", default=[], metavar="NAME=PATH",
                    help="a policy JSON (formats and scales) to measure; repeatable")
    a = ap.parse_args()
    configs: list[tuple[str, Optional[KVPolicy]]] = [("unquantized (bf16)", None)]
    try:
        for spec in a.policy:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                ap.error(f"--policy takes NAME=PATH, got {spec!r}")
            configs.append((name, KVPolicy.load(Path(path))))
        model, tokenizer, info = load_model(a.model)
        for name, policy in configs[1:]:
            policy.check_model(info.num_layers, info.num_kv_heads, info.head_dim)
        toks = load_windows(a.data, tokenizer, a.window, a.windows, 0, info.max_positions)
    except (PolicyError, ModelError, DataError) as e:
        ap.error(str(e))
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows = []
    for name, policy in progress(configs, desc="configurations", unit="config"):
        row = {"name": name, "policy": policy.to_compact() if policy else None,
               "fp8_fraction": round(policy.fraction_of_fp8(), 4) if policy else 2.0,
               **measure(model, toks.eval, policy, a.seed, a.rel)}
        rows.append(row)
        print(f"{name:32s} agreement {row['argmax_agreement']:.4f}  mean |d lp| "
              f"{row['mean_abs_dlogprob']:.4f}  max {row['max_abs_dlogprob']:.3f}", flush=True)
    result = {"model": info.to_dict(), "data": toks.describe(), "rel": a.rel,
              "seed": a.seed, "seconds": round(time.time() - t0, 1), "rows": rows}
    (a.out / "kv_rounding_sensitivity.json").write_text(json.dumps(result, indent=2) + "\n")
    (a.out / "kv_rounding_sensitivity.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
