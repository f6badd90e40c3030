"""Candidate default rules for hybrid / sliding-window models, compared on accuracy and capacity.

Candidates (compact policies built from a model's layer types; "growing" = the full-attention
layers, or every KV layer of a model without full attention):

* ``a`` today's rule (:func:`vllm_nvfp4.policy.default_rule.default_rule_text`);
* ``b`` sliding NVFP4, first and last growing layer FP8;
* ``c`` sliding FP8, every growing layer NVFP4;
* ``d`` sliding FP8, first growing layer FP8, the other growing layers NVFP4;
* ``e`` every layer NVFP4;
* ``f`` sliding NVFP4, first growing layer FP8;
* ``fp8`` every layer FP8 (the floor the NVFP4 layers are measured against).

Candidates that give a model the same formats are measured once and reported under all names.

``accuracy``: for each tiny hybrid model (:mod:`vllm_nvfp4.testing.hybrid_models`, float32,
CPU head dims) and weight seed, scales calibrated as the start-up calibration does (the
package's calibration text, per-layer amax, K centering unless the attention is soft-capped),
then next-token KL, delta NLL and top-1 agreement against the unquantized model on held-out
windows longer than the sliding window (:class:`~vllm_nvfp4.calibration.evaluator.Evaluator`).
``--model DIR`` measures a real model instead (one "seed": its weights).

``capacity``: per candidate at a weight-less preset's geometry, KV bytes per token and the
requests held at a context (the plan of ``python -m benchmarks.e2e --dry-run``: 64 GiB of KV,
vLLM's admission with the sliding layers' window plus the tokens in flight).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from vllm_nvfp4.policy import KVPolicy, LayerType
from vllm_nvfp4.policy.default_rule import default_rule_text

CANDIDATES = ("a", "b", "c", "d", "e", "f", "fp8")
DESCRIPTIONS = {
    "a": "today: sliding FP8, first/last full FP8",
    "b": "sliding NVFP4, first/last full FP8",
    "c": "sliding FP8, all full NVFP4",
    "d": "sliding FP8, first full FP8",
    "e": "all NVFP4",
    "f": "sliding NVFP4, first full FP8",
    "fp8": "all FP8",
}


def candidate_text(name: str, layer_types: Sequence[LayerType]) -> str:
    """The compact policy of candidate ``name`` (module doc) for ``layer_types``."""
    kv = [i for i, t in enumerate(layer_types) if t.holds_kv]
    growing = [i for i in kv if layer_types[i].kind == "full"] or kv
    has_sliding = any(layer_types[i].kind == "sliding" for i in kv)
    has_full = any(layer_types[i].kind == "full" for i in kv)
    sliding_fp8 = ["swa:fp8"] if has_sliding and has_full else []
    rest = "full:nvfp4" if has_full else "*:nvfp4"
    first, last = f"{growing[0]}:fp8", f"{growing[-1]}:fp8"
    rules: dict[str, Callable[[], list[str]]] = {
        "a": lambda: [default_rule_text(layer_types)[0]],
        "b": lambda: [first, last, "*:nvfp4"],
        "c": lambda: sliding_fp8 + [rest],
        "d": lambda: [first] + sliding_fp8 + [rest],
        "e": lambda: ["*:nvfp4"],
        "f": lambda: [first, "*:nvfp4"],
        "fp8": lambda: ["*:fp8"],
    }
    if name not in rules:
        raise ValueError(f"unknown candidate {name!r}; choose from {', '.join(CANDIDATES)}")
    return ",".join(dict.fromkeys(rules[name]()))


def candidate_policies(names: Sequence[str], layer_types: Sequence[LayerType]
                       ) -> list[tuple[list[str], KVPolicy]]:
    """Distinct policies of ``names`` for ``layer_types``: ``[(names giving it, policy)]``."""
    out: list[tuple[list[str], KVPolicy]] = []
    n = len(layer_types)
    for name in names:
        p = KVPolicy.from_compact(candidate_text(name, layer_types), n, source=name,
                                  layer_types=layer_types)
        formats = [(lp.k, lp.v) for lp in p.layers]
        for group, q in out:
            if [(lp.k, lp.v) for lp in q.layers] == formats:
                group.append(name)
                break
        else:
            out.append(([name], p))
    return out


# ------------------------------------------------------------------------------------ accuracy
def _windows(tokenizer: Any, path: Path, window: int, count: int) -> Any:
    """``count`` windows ``[count, window]`` of ``path``, each led by the tokenizer's BOS if it adds one."""
    from vllm_nvfp4.calibration.data import load_windows

    return load_windows([path], tokenizer, window, count).eval


def measure_model(model_dir: Path, names: Sequence[str], eval_text: Path, window: int,
                  windows: int, calib_window: int, calib_windows: int, dtype: str) -> dict[str, Any]:
    """Calibrate (start-up recipe) and measure every distinct candidate on one model."""
    from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT
    from vllm_nvfp4.calibration.commands import soft_capped
    from vllm_nvfp4.calibration.evaluator import Evaluator
    from vllm_nvfp4.calibration.modeling import load_model
    from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy

    t0 = time.time()
    model, tokenizer, info = load_model(model_dir, dtype, "cpu")
    calib = _windows(tokenizer, BUILTIN_TEXT, calib_window, calib_windows)
    observer = observe_amax(model, calib, info.num_layers, kv_layers=info.kv_layers)
    k_center = not soft_capped(model_dir)
    held_out = _windows(tokenizer, eval_text, window, windows)
    evs = [Evaluator(model, held_out[w:w + 1], reuse_prefix=False) for w in range(windows)]
    refs = [ev.reference() for ev in evs]
    out: dict[str, Any] = {"model": str(model_dir), "layer_types": [t.label() for t in info.layer_types],
                           "reference_nll": sum(r.nll for r in refs) / windows, "k_center": k_center,
                           "results": {}}
    for group, formats in candidate_policies(names, info.layer_types):
        policy = scaled_policy(formats, observer, k_center=k_center)
        ms = [ev.measure(policy) for ev in evs]  # windows are equally long: means of means
        row: dict[str, Any] = {"policy": formats.to_compact(), "fraction_of_fp8": formats.fraction_of_fp8(),
                               "tokens": sum(m.tokens for m in ms),
                               "dnll_se": math.sqrt(sum(m.dnll_se ** 2 for m in ms)) / windows}
        for key in ("kl", "dnll", "top1"):
            row["per_window_" + key] = [getattr(m, key) for m in ms]
            row[key] = sum(row["per_window_" + key]) / windows
        for name in group:
            out["results"][name] = row
    out["seconds"] = round(time.time() - t0, 1)
    del model
    return out


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    mu = sum(values) / len(values)
    sd = math.sqrt(sum((v - mu) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mu, sd


def window_runs(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One model's windows as runs of :func:`summarize_runs` (the spread of a single model)."""
    n = len(next(iter(run["results"].values()))["per_window_kl"])
    return [{"results": {name: dict(row, **{k: row["per_window_" + k][w] for k in ("kl", "dnll", "top1")})
                         for name, row in run["results"].items()}} for w in range(n)]


def summarize_runs(runs: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Per candidate: mean and sample SD over runs of KL, delta NLL, top-1, and its KL relative
    to today's rule (``a``) within each run (mean, SD, runs where it is lower)."""
    out: dict[str, Any] = {}
    for name in names:
        rows = [r["results"][name] for r in runs]
        s: dict[str, Any] = {"policy": rows[0]["policy"], "same_as": []}
        for key in ("kl", "dnll", "top1"):
            s[key], s[key + "_sd"] = _mean_sd([row[key] for row in rows])
        rel = [row["kl"] / r["results"]["a"]["kl"] for row, r in zip(rows, runs)]
        s["kl_vs_a"], s["kl_vs_a_sd"] = _mean_sd(rel)
        s["runs_kl_below_a"] = sum(x < 1.0 for x in rel)
        s["fraction_of_fp8"] = rows[0]["fraction_of_fp8"]
        out[name] = s
    for name in names:  # candidates giving the same formats in every run
        out[name]["same_as"] = [o for o in names if o != name and all(
            r["results"][o]["policy"] == r["results"][name]["policy"] for r in runs)]
    return out


def run_accuracy(a: argparse.Namespace) -> dict[str, Any]:
    """The accuracy comparison (module doc): ``{arch: {"runs": [...], "summary": {...}}}``."""
    from vllm_nvfp4.testing.assets import asset_path
    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid

    eval_text = Path(a.eval_text) if a.eval_text else asset_path("brown")
    targets: list[tuple[str, list[Path]]]
    if a.model:
        targets = [(Path(a.model).name, [Path(a.model)])]
    else:
        targets = [(arch, [build_tiny_hybrid(arch, seed=s) for s in a.seeds]) for arch in a.archs]
    out: dict[str, Any] = {}
    for label, dirs in targets:
        runs = []
        for d in dirs:
            r = measure_model(d, a.candidates, eval_text, a.window, a.windows, a.calib_window,
                              a.calib_windows, a.dtype)
            print(f"{label} {d.name}: " + ", ".join(
                f"{n} kl={r['results'][n]['kl']:.5f}" for n in a.candidates) + f" ({r['seconds']} s)",
                file=sys.stderr, flush=True)
            runs.append(r)
        over = runs if len(runs) > 1 else window_runs(runs[0])
        out[label] = {"runs": runs, "spread_over": "seeds" if len(runs) > 1 else "windows",
                      "summary": summarize_runs(over, a.candidates)}
    return out


def accuracy_table(results: dict[str, Any]) -> str:
    """Markdown: one row per model and distinct candidate."""
    lines = ["| model | candidate | policy | KL (nats) | delta NLL | top-1 agree | KL / today's | KL < today's in |",
             "|---|---|---|---|---|---|---|---|"]
    for label, res in results.items():
        n = f"{len(res['runs'])} seeds" if res["spread_over"] == "seeds" else \
            f"{len(res['runs'][0]['results']['a']['per_window_kl'])} windows"
        done: set[str] = set()
        for name, s in res["summary"].items():
            if name in done:
                continue
            done.update([name, *s["same_as"]])
            names = "=".join([name, *s["same_as"]])
            lines.append(f"| {label} | {names} | `{s['policy']}` | {s['kl']:.5f} ± {s['kl_sd']:.5f} | "
                         f"{s['dnll']:.5f} ± {s['dnll_sd']:.5f} | {s['top1']:.4f} ± {s['top1_sd']:.4f} | "
                         f"{s['kl_vs_a']:.3f} ± {s['kl_vs_a_sd']:.3f} | {s['runs_kl_below_a']} of {n} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ capacity
def run_capacity(a: argparse.Namespace) -> dict[str, Any]:
    """Per preset, tokens in flight and candidate: bytes per token and requests held at
    ``a.context`` tokens (64 GiB of KV), against fp8."""
    from benchmarks.e2e.capacity import estimate_batch, kv_bytes_per_token, pool_layout
    from benchmarks.e2e.orchestrate import PLAN_BLOCK_SIZE, PLAN_KV_BYTES
    from vllm_nvfp4.integration.block_sizes import arithmetic_request_bytes, hybrid_plan
    from vllm_nvfp4.model_shape import ModelShape
    from vllm_nvfp4.testing.weightless import build_weightless_model

    out: dict[str, Any] = {}
    headroom = 1024
    max_len = a.context + headroom
    for preset in a.presets:
        shape = ModelShape.from_model_dir(build_weightless_model(f"/tmp/vllm-nvfp4-models/{preset}-random",
                                                                 preset))
        rows: dict[str, Any] = {}
        for in_flight in a.in_flight:
            fp8 = pool_layout("fp8", shape, None, PLAN_BLOCK_SIZE, max_len, in_flight)
            ref = estimate_batch(PLAN_KV_BYTES, fp8, max_len, in_flight, 4096)
            fp8_policy = KVPolicy.from_compact("*:fp8", shape.num_layers, layer_types=shape.layer_types)
            ref_admit = arithmetic_request_bytes(fp8_policy, shape.num_kv_heads, shape.head_dim,
                                                 a.context, in_flight, PLAN_BLOCK_SIZE)
            row: dict[str, Any] = {"fp8": {"requests": ref, "admission_request_bytes": ref_admit,
                                           "admission_requests": PLAN_KV_BYTES // ref_admit}}
            for group, p in candidate_policies(CANDIDATES[:-1], shape.layer_types):
                text = p.to_compact()
                layout = pool_layout("nvfp4_mixed", shape, text, PLAN_BLOCK_SIZE, max_len, in_flight)
                n = estimate_batch(PLAN_KV_BYTES, layout, max_len, in_flight, 4096)
                admit = hybrid_plan(p, shape.num_kv_heads, shape.head_dim, PLAN_BLOCK_SIZE,
                                    a.context, in_flight).request_bytes
                for name in group:
                    row[name] = {"policy": text, "requests": n, "vs_fp8": round(n / ref, 3),
                                 "bytes_per_token": kv_bytes_per_token("nvfp4_mixed", shape, text),
                                 "admission_request_bytes": admit,
                                 "admission_requests": PLAN_KV_BYTES // admit,
                                 "admission_vs_fp8": round(ref_admit / admit, 3)}
            rows[str(in_flight)] = row
        out[preset] = {"layer_types": {t.label(): shape.layer_types.count(t) for t in dict.fromkeys(shape.layer_types)},
                       "fp8_bytes_per_token": kv_bytes_per_token("fp8", shape), "context": a.context,
                       "in_flight": rows}
    return out


def capacity_table(results: dict[str, Any]) -> str:
    """Markdown: requests held (x fp8) per preset, candidate and tokens in flight: decoding
    (the e2e plan) / admitted (vLLM's admission bound)."""
    lines = []
    for preset, res in results.items():
        flights = list(res["in_flight"])
        lines += [f"{preset} ({', '.join(f'{v} {k}' for k, v in res['layer_types'].items())}), "
                  f"{res['context']} tokens per request, 64 GiB of KV; requests decoding (e2e plan) "
                  f"/ admitted (admission bound), x fp8, by tokens in flight:", "",
                  "| candidate | bytes/token | " + " | ".join(f"{f} in flight" for f in flights) + " |",
                  "|---|---|" + "---|" * len(flights)]
        fp8 = " | ".join(f"{res['in_flight'][f]['fp8']['requests']} / "
                         f"{res['in_flight'][f]['fp8']['admission_requests']}" for f in flights)
        lines.append(f"| fp8 | {res['fp8_bytes_per_token']} | {fp8} |")
        for name in CANDIDATES[:-1]:
            cells = [res["in_flight"][f][name] for f in flights]
            lines.append(f"| {name} | {cells[0]['bytes_per_token']} | " + " | ".join(
                f"{c['requests']} / {c['admission_requests']} ({c['vs_fp8']:.2f}x / "
                f"{c['admission_vs_fp8']:.2f}x)" for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    acc = sub.add_parser("accuracy", help="KL / delta NLL / top-1 on tiny hybrid models or --model")
    acc.add_argument("--archs", nargs="+", default=["gemma3", "gpt_oss", "mistral", "qwen3_next"])
    acc.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    acc.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES,
                     help="candidates measured (a, today's rule, is always among them)")
    acc.add_argument("--model", default=None, help="a real model directory instead of the tiny ones")
    acc.add_argument("--dtype", default="float32")
    acc.add_argument("--eval-text", default=None, help="held-out text (default: the Brown corpus asset)")
    acc.add_argument("--window", type=int, default=512, help="tokens per held-out window")
    acc.add_argument("--windows", type=int, default=8)
    acc.add_argument("--calib-window", type=int, default=1024, help="as the start-up calibration")
    acc.add_argument("--calib-windows", type=int, default=4)
    cap = sub.add_parser("capacity", help="bytes per token and requests held at real geometries")
    cap.add_argument("--presets", nargs="+", default=["gpt-oss-20b", "gemma3-27b"])
    cap.add_argument("--context", type=int, default=32768)
    cap.add_argument("--in-flight", nargs="+", type=int, default=[2048, 8192, 16384])
    for p in (acc, cap):
        p.add_argument("--out", required=True, help="JSON file written")
        p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    a = ap.parse_args(argv)
    if a.cmd == "accuracy" and "a" not in a.candidates:
        a.candidates = ["a", *a.candidates]
    import torch

    torch.set_num_threads(a.threads)
    t0 = time.time()
    results = run_accuracy(a) if a.cmd == "accuracy" else run_capacity(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "seconds": round(time.time() - t0, 1),
                                       "results": results}, indent=1) + "\n")
    print(accuracy_table(results) if a.cmd == "accuracy" else capacity_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
