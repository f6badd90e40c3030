"""How far a last-bit change of K/V moves next-token predictions, per KV-cache configuration.

Decode and prefill compute a token's K/V in differently shaped matmuls, so the bf16 values they
write into the cache can differ in the last bit. A BF16 cache passes such a difference through; a
quantized cache can turn it into a whole quantization step when a value sits near a rounding
threshold. This measures that amplification in transformers (the calibration code path, which
fake-quantizes K/V exactly as vLLM stores them): teacher-forced log-probs of real text with the K
and V projections computed in FP32 and rounded to bf16, and again with every FP32 output element
moved by a seeded relative amount of at most ``--rel`` before that rounding, for an unquantized
cache and for each given policy. Choose ``--rel`` so that the unquantized row matches the
decode-vs-prefill difference measured on a BF16 cache; the quantized rows then show how much of
their own decode-vs-prefill difference rounding alone explains. Reported per configuration:
argmax agreement of the two runs and the mean / max |difference| of the text tokens' log-probs.

    python -m studies.kv_rounding_sensitivity MODEL_DIR --data brown.txt --out DIR \
        [--window 1024] [--windows 2] [--policy NAME=policy.json ...] [--rel 2^-16] [--seed 0]

Writes ``DIR/kv_rounding_sensitivity.json`` and ``.md``; progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from vllm_nvfp4.calibration.data import DataError, add_text_arguments, load_windows
from vllm_nvfp4.calibration.hf_model import attention_modules
from vllm_nvfp4.calibration.kv_hooks import kv_cache_quantization
from vllm_nvfp4.calibration.modeling import ModelError, load_model
from vllm_nvfp4.calibration.progress import progress
from vllm_nvfp4.policy import KVPolicy, PolicyError


@contextlib.contextmanager
def kv_projections_in_fp32(model: torch.nn.Module, seed: Optional[int], rel: float
                           ) -> Iterator[None]:
    """Within the block every ``k_proj``/``v_proj`` output is recomputed in FP32, ``y32``, and
    rounded once to the model dtype: ``bf16(y32)``, or with ``seed`` given
    ``bf16(y32 * (1 + u * rel))``, ``u ~ U(-1, 1)`` from a generator seeded per call order (the
    same for every configuration). A perturbation far below one bf16 ulp changes only the elements
    whose FP32 value lies near a rounding boundary, as a different summation order does."""
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    handles = []

    def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        bias = module.bias.float() if module.bias is not None else None
        y32 = torch.nn.functional.linear(args[0].float(), module.weight.float(), bias)
        if seed is not None:
            u = torch.rand(y32.shape, generator=gen, dtype=torch.float32) * 2.0 - 1.0
            y32 = y32 * (1.0 + u * rel)
        return y32.to(out.dtype)

    for attn in attention_modules(model):
        handles += [attn.k_proj.register_forward_hook(hook), attn.v_proj.register_forward_hook(hook)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def log_probs(model: torch.nn.Module, window: torch.Tensor, policy: Optional[KVPolicy],
              perturb_seed: Optional[int], rel: float) -> torch.Tensor:
    """FP32 log-probs ``[T - 1, vocab]`` of tokens 1.. of ``window [T]`` under ``policy`` (None:
    unquantized K/V), K/V projections in FP32 (:func:`kv_projections_in_fp32`), perturbed by up
    to ``rel`` (relative) when ``perturb_seed`` is given."""
    with torch.no_grad(), kv_cache_quantization(model, policy), \
            kv_projections_in_fp32(model, perturb_seed, rel):
        logits = model(window.view(1, -1)).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def compare(ref: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Argmax agreement and |difference| of the targets' log-probs between two runs."""
    diff = (ref.gather(1, targets[:, None]) - other.gather(1, targets[:, None])).abs()
    return {"tokens": int(targets.numel()),
            "argmax_agreement": float((ref.argmax(-1) == other.argmax(-1)).float().mean()),
            "mean_abs_dlogprob": float(diff.mean()), "max_abs_dlogprob": float(diff.max())}


def measure(model: torch.nn.Module, windows: Sequence[torch.Tensor], policy: Optional[KVPolicy],
            seed: int, rel: float) -> dict[str, float]:
    """:func:`compare` of the unperturbed and the perturbed run of every window (window ``i``
    perturbed with seed ``seed + i``), pooled over their text tokens: token-weighted agreement
    and mean, the largest max."""
    parts = []
    for i, window in enumerate(windows):
        ref = log_probs(model, window, policy, None, rel)
        pert = log_probs(model, window, policy, seed + i, rel)
        parts.append(compare(ref, pert, window[1:].long()))
    n = sum(p["tokens"] for p in parts)
    return {"tokens": n,
            "argmax_agreement": sum(p["argmax_agreement"] * p["tokens"] for p in parts) / n,
            "mean_abs_dlogprob": sum(p["mean_abs_dlogprob"] * p["tokens"] for p in parts) / n,
            "max_abs_dlogprob": max(p["max_abs_dlogprob"] for p in parts)}


def markdown(result: dict) -> str:
    """The rows of a result (``{"rows": [...]}``) as a Markdown table."""
    lines = ["| configuration | KV bytes / FP8 | tokens | argmax agreement | mean abs d log-prob | "
             "max abs d log-prob |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['fp8_fraction']} | {r['tokens']} | "
                     f"{r['argmax_agreement']:.4f} | {r['mean_abs_dlogprob']:.4f} | "
                     f"{r['max_abs_dlogprob']:.3f} |")
    return "\n".join(lines) + "\n"


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
