"""Delta NLL / KL against the unquantized model of whole-model policies with and without the K
transforms (K smoothing, K centering, both), through the calibration code path (transformers +
the fake-quant hook that mirrors the vLLM integration bit for bit).

    python -m studies.compare_k_smoothing MODEL_DIR --data brown.txt --out DIR \
        [--window 2048] [--windows 1] [--alpha 1.0] [--policy policy.json]

Calibrates per-layer scales on one window (plain, ``--k-smooth ALPHA``, ``--k-center``, both),
then scores the following ``--windows`` windows for all-FP8, all-NVFP4 and, with ``--policy``,
that policy's formats, each with every calibration. Writes ``DIR/k_smoothing.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vllm_nvfp4.calibration.data import add_text_arguments, load_windows
from vllm_nvfp4.calibration.evaluator import Evaluator
from vllm_nvfp4.calibration.modeling import load_model
from vllm_nvfp4.calibration.progress import progress
from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy, with_formats
from vllm_nvfp4.policy import KVPolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_text_arguments(ap, 2048, 1)  # --windows: scored windows after the calibration one
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--alpha", type=float, default=1.0, help="K smoothing exponent")
    ap.add_argument("--policy", type=Path, default=None, help="also score this policy's formats")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, tokenizer, info = load_model(a.model)
    toks = load_windows(a.data, tokenizer, a.window, a.windows, 1, info.max_positions)
    observer = observe_amax(model, toks.calib, info.num_layers)
    every = KVPolicy.from_compact("*:fp8", info.num_layers)
    scales = {"plain": scaled_policy(every, observer),
              f"k_smooth {a.alpha:g}": scaled_policy(every, observer, k_smooth_alpha=a.alpha),
              "k_center": scaled_policy(every, observer, k_center=True),
              f"k_center + k_smooth {a.alpha:g}": scaled_policy(every, observer, k_smooth_alpha=a.alpha,
                                                                k_center=True)}
    formats = {"all-FP8": every, "all-NVFP4": KVPolicy.from_compact("*:nvfp4", info.num_layers)}
    if a.policy is not None:
        formats[a.policy.name] = KVPolicy.load(a.policy)
    ev = Evaluator(model, toks.eval, reuse_prefix=False)
    ev.reference()
    rows = []
    for (fname, fmt), (sname, sc) in progress(
            [(f, s) for f in formats.items() for s in scales.items()], desc="policies", unit="policy"):
        m = ev.measure(with_formats(sc, fmt, source=f"{fname}, {sname}"))
        rows.append({"formats": fname, "scales": sname, "fp8_fraction": fmt.fraction_of_fp8(),
                     **m.to_dict()})
        print(f"{fname:24s} {sname:24s} dNLL {m.dnll:+.4f} +- {m.dnll_se:.4f}  KL {m.kl:.4f}", flush=True)
    result = {"model": info.to_dict(), "data": toks.describe(), "alpha": a.alpha,
              "seconds": round(time.time() - t0, 1), "rows": rows}
    (a.out / "k_smoothing.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| formats | KV bytes / FP8 | scales | delta NLL (nats/token) | KL |", "|---|---:|---|---:|---:|"]
    lines += [f"| {r['formats']} | {r['fp8_fraction']:.4f} | {r['scales']} | {r['dnll']:+.4f} "
              f"(se {r['dnll_se']:.4f}) | {r['kl']:.4f} |" for r in rows]
    (a.out / "k_smoothing.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}/k_smoothing.json, .md in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
