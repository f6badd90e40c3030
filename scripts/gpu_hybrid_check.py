#!/usr/bin/env python3
"""``kv_cache_dtype="nvfp4_mixed"`` on hybrid / sliding-window models on a CUDA GPU (SM90 or newer).

Per architecture (tiny random-weight models of :func:`vllm_nvfp4.testing.hybrid_models.build_tiny_hybrid`:
``gemma3``, ``gpt_oss`` (sinks, MoE), ``mistral`` (window on every layer), ``qwen3_next``
(Gated DeltaNet hybrid, MoE)), with a by-type policy written into the model directory
(``swa:fp8,full:nvfp4,<last full>:fp8``; all-sliding: ``*:nvfp4,0:fp8``; Qwen3-Next:
``full:nvfp4,<last full>:fp8``; ``gemma3_swa_mix``: the Gemma 3 model with sliding layers of
two format pairs in unequal numbers, ``mixed_sliding_policy_text``), engine A runs as users run
it (CUDA graphs, prefix caching, chunked prefill of 128 tokens); with ``--compare-eager`` an engine B, eager with neither. On
CUDA the models take the head dims of the real ones (:data:`GPU_HEAD_DIMS`: the kernels need
>= 64). Hard checks:

* our impl serves every KV layer, with the layer's window and sinks; CUDA graphs are on;
* sliding layers sit in sliding-window groups, full layers in the full-attention group; on
  full + sliding models vLLM formed the groups :func:`hybrid_plan` predicts (block sizes, block
  bytes, blocks per request) and a request reserves >= 0.95x the format arithmetic
  (:func:`arithmetic_request_bytes`); on Mamba / GDN hybrids the full-attention group is the
  block and the widest state group fills it to under a byte per token and state;
* greedy decoding is deterministic (graph replays; two runs that both hit the prefix cache);
* except on Mamba / GDN hybrids (vLLM caches their state its own way; its GDN kernels and
  transformers' differ more than the KV formats do): a prefix-cache hit gives the cold tokens,
  and prompt log-probs are nearer to transformers with the same fake quantization than to the
  unquantized model (ratio < ``TOL_RATIO``).

Two variants of the policy:

* ``--startup-calibration``: no policy file, so the engine calibrates at start-up on the
  package's text (into a fresh ``$VLLM_NVFP4_CACHE``); also checked: it wrote one cached
  policy with calibrated scales, and that policy is the one every check and the reference use;
* ``--k-perm``: every layer whose K is NVFP4 stores its K channels in a random order per KV head
  (the policy's ``k_perm``; queries are permuted alike), the reference likewise.

Reported, not checked: cold vs prefix-cached greedy tokens, A vs B greedy agreement, the plan,
vLLM's KV-cache size in tokens, decode tokens/s of 32 requests.

    python scripts/gpu_hybrid_check.py --out hybrid_h200.json [--arch gemma3 gpt_oss ...] \
        [--startup-calibration | --k-perm]

Writes the JSON after every architecture and prints ``RESULT {...}``; exit 0 when every hard
check of every architecture passed. ``--device cpu`` is a dry run on vLLM's CPU build (eager: the
CUDA-graph check fails by design).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ARCHS = ("gpt_oss", "gemma3", "qwen3_next", "mistral", "gemma3_swa_mix")  # the first two matter most
#: ``gemma3_swa_mix``: the tiny Gemma 3 with sliding layers of two format pairs in unequal numbers
#: (:func:`vllm_nvfp4.testing.hybrid_models.mixed_sliding_policy_text`)
MIXED_SUFFIX = "_swa_mix"
TOL_RATIO = 0.75
KV_BYTES = 2 << 30
BLOCK = 16  # the configured block size of the full + sliding models (CUDA's default)
QK_GAIN = 0.5  # mild attention: bf16 rounding flips stay small in a random model


def greedy(n: int, **kw: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def gen(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def with_random_k_perm(policy: Any, num_kv_heads: int, head_dim: int, seed: int = 0) -> Any:
    """``policy`` with a random K channel order per KV head (``k_perm``) on every layer whose K
    is NVFP4."""
    gen_ = torch.Generator().manual_seed(seed)
    for i, lp in policy.kv_layers():
        if lp.k == "nvfp4":
            perm = [torch.randperm(head_dim, generator=gen_).tolist() for _ in range(num_kv_heads)]
            policy = policy.with_layer(i, k_perm=perm)
    return policy


def startup_policy(cache_root: Path) -> Any:
    """The one policy the start-up calibration cached under ``cache_root``."""
    from vllm_nvfp4.calibration.startup_cache import STARTUP_SUBDIR
    from vllm_nvfp4.policy import KVPolicy

    files = sorted((cache_root / STARTUP_SUBDIR).glob("*.json"))
    if len(files) != 1:
        raise RuntimeError(f"expected one cached start-up calibration in {cache_root}, found {len(files)}")
    return KVPolicy.load(files[0])


def check_arch(arch: str, device: str, work: Path, compare_eager: bool,
               dtype: str = "bfloat16", gpu_head_dims: bool = False,
               batched_tokens: int = 128, variant: str = "by_type") -> dict[str, Any]:
    import shutil

    from transformers import AutoConfig
    from vllm import LLM

    from vllm_nvfp4.calibration.startup_cache import CACHE_ENV
    from vllm_nvfp4.policy import POLICY_FILENAME
    from vllm_nvfp4.testing.kv_report import kv_cache_report
    from vllm_nvfp4.integration.block_sizes import arithmetic_request_bytes, hybrid_plan
    from vllm_nvfp4.testing.hybrid_models import (GPU_HEAD_DIMS, build_tiny_hybrid,
                                                  by_type_policy_text, mixed_sliding_policy_text,
                                                  write_by_type_policy)
    from vllm_nvfp4.testing.reference import reference_logprobs

    case, mixed = arch, arch.endswith(MIXED_SUFFIX)
    arch = arch.removesuffix(MIXED_SUFFIX)
    # the CUDA kernels: >= 64; on CPU the CUDA geometry (hence the same block plan) on request
    head_dim = GPU_HEAD_DIMS[arch] if device == "cuda" or gpu_head_dims else None
    model_dir = build_tiny_hybrid(arch, work / f"{case}-{head_dim}-{variant}", qk_gain=QK_GAIN,
                                  head_dim=head_dim)
    policy = write_by_type_policy(
        model_dir, mixed_sliding_policy_text if mixed else by_type_policy_text)
    cache_root = work / f"startup-cache-{case}"
    if variant == "startup_calibration":  # no policy file: the engine calibrates into a fresh cache
        (model_dir / POLICY_FILENAME).unlink()
        shutil.rmtree(cache_root, ignore_errors=True)
        os.environ[CACHE_ENV] = str(cache_root)
    elif variant == "k_perm":
        text_config = AutoConfig.from_pretrained(model_dir).get_text_config()
        policy = with_random_k_perm(policy, text_config.num_key_value_heads, text_config.head_dim)
        policy.save(model_dir / POLICY_FILENAME, overwrite=True)
    # Mamba / GDN: vLLM's state, its own caching
    state = not all(t.holds_kv for t in policy.layer_types)
    extra = {"additional_config": {"gdn_prefill_backend": "triton"}} if arch == "qwen3_next" else {}
    common = dict(model=str(model_dir), kv_cache_dtype="nvfp4_mixed", dtype=dtype,
                  max_model_len=4096, seed=0, kv_cache_memory_bytes=KV_BYTES,
                  gpu_memory_utilization=0.5, **extra)
    if not state:  # pinned: vLLM later sets cache_config.block_size to its smallest group's
        common["block_size"] = BLOCK
    if device == "cpu":  # the dry run: vLLM's CPU build compiles for minutes
        common["enforce_eager"] = True
    r: dict[str, Any] = {"arch": case, "dtype": dtype, "variant": variant, "checks": {}}
    checks = r["checks"]
    t0 = time.time()
    llm = LLM(**common, enable_prefix_caching=True, max_num_batched_tokens=batched_tokens,
              max_num_seqs=32)
    r["start_s"] = round(time.time() - t0, 1)
    if variant == "startup_calibration":
        policy = startup_policy(cache_root)
        provenance = policy.provenance
        r["startup_tokens"] = provenance.get("tokens")
        checks["calibrated_at_startup"] = (
            provenance.get("tool") == "vllm-nvfp4 start-up calibration"
            and all(getattr(lp, f) is not None for _, lp in policy.kv_layers()
                    for f in (("k_scale" if lp.k == "fp8" else "k_global_scale"),
                              ("v_scale" if lp.v == "fp8" else "v_global_scale"))))
    r["policy"] = policy.to_compact()
    tok = llm.get_tokenizer()
    import inspect
    import textwrap

    ids = tok(inspect.getsource(textwrap))["input_ids"]
    prompts = [ids[300 * i:300 * i + 200 + 40 * i] for i in range(4)]  # > every window (32/48)
    prefix = [ids[:400] + ids[2000 + 50 * i:2000 + 50 * i + 30] for i in range(3)]
    report = llm.collective_rpc(kv_cache_report)[0]
    r["report"] = {k: v for k, v in report.items() if k != "impls"}
    kinds = {int(n.split(".")[2]): g["kind"] for g in report["groups"] for n in g["layer_pages"]}
    checks["impl_on_every_kv_layer"] = (
        len(report["impls"]) == len(policy.kv_layers())
        and all(v["impl"] == "Nvfp4MixedImpl" for v in report["impls"].values()))
    checks["window_and_sinks"] = all(
        v["window"] == policy.layers[int(n.split(".")[2])].layer_type.window
        and v["sinks"] == policy.layers[int(n.split(".")[2])].layer_type.sinks
        for n, v in report["impls"].items())
    checks["sliding_layers_in_sliding_groups"] = all(
        kinds.get(i) == ("SlidingWindowSpec" if lp.layer_type.kind == "sliding" else "FullAttentionSpec")
        for i, lp in policy.kv_layers())
    mc = llm.llm_engine.vllm_config
    heads, dim = mc.model_config.get_num_kv_heads(mc.parallel_config), mc.model_config.get_head_size()
    length, in_flight = report["max_model_len"], report["max_in_flight_tokens"]
    # full + sliding: the block the plugin planned from; Mamba / GDN: the platform's
    block = BLOCK if not state else report["configured_block_size"]
    plan = hybrid_plan(policy, heads, dim, block, length, in_flight)
    if plan is not None:  # full + sliding: the groups vLLM formed are the planned ones
        full = [g for g in report["groups"] if g["kind"] == "FullAttentionSpec"]
        r["plan"] = {k: getattr(plan, k) for k in ("full_block", "sliding_block", "sliding_groups",
                                                   "block_bytes", "request_blocks", "full_groups")}
        checks["groups_as_planned"] = (
            len(full) == plan.full_groups == 1 and full[0]["block_size"] == plan.full_block
            and len(report["groups"]) - len(full) == plan.sliding_groups
            and full[0]["page_bytes"] == plan.full_block * policy.kv_bytes_per_token(heads, dim, ("full",))
            and report["block_bytes"] == plan.block_bytes
            and report["allocated_per_request"] == plan.request_bytes)
    arithmetic = arithmetic_request_bytes(policy, heads, dim, length, in_flight, block)
    r["arithmetic_over_allocated"] = round(arithmetic / report["allocated_per_request"], 4)
    if not state:  # with Mamba / GDN state vLLM sizes those pages itself
        checks["capacity_ge_0.95_arithmetic"] = r["arithmetic_over_allocated"] >= 0.95
    else:  # the state_alignment hook: the full group is the block, the widest state group fills it
        full = [g for g in report["groups"] if g["kind"] == "FullAttentionSpec"]
        widest = max((g for g in report["groups"] if g["kind"] == "MambaSpec"),
                     key=lambda g: g["page_bytes"])
        checks["state_groups_fill_blocks"] = (
            len(full) == 1 and full[0]["page_bytes"] == report["block_bytes"]
            and report["block_bytes"] - widest["page_bytes"]
            < full[0]["block_size"] * len(widest["layer_pages"]))
    checks["cuda_graphs_on"] = str(mc.compilation_config.cudagraph_mode) not in ("NONE", "CUDAGraphMode.NONE")
    # the first run prefills cold, the next two hit the prefix cache (other kernels, other
    # rounding): determinism is between the warm runs; cold vs warm is reported
    a1, a2, a3 = gen(llm, prompts, 32), gen(llm, prompts, 32), gen(llm, prompts, 32)
    checks["greedy_deterministic"] = a2 == a3
    r["cold_vs_warm_tokens_equal"] = round(
        sum(x == y for p, q in zip(a1, a2) for x, y in zip(p, q)) / sum(map(len, a1)), 3)
    cold = gen(llm, prefix[:1], 16)
    warm = llm.generate([{"prompt_token_ids": prefix[0]}], greedy(16), use_tqdm=False)[0]
    r["prefix_hit_tokens"] = warm.num_cached_tokens
    r["prefix_hit_same_tokens"] = list(warm.outputs[0].token_ids) == cold[0]
    if not state:
        checks["prefix_hit_same_tokens"] = warm.num_cached_tokens >= 128 and r["prefix_hit_same_tokens"]
    lp = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(1, prompt_logprobs=0), use_tqdm=False)
    got = torch.tensor([o.prompt_logprobs[i][t].logprob for o, p in zip(lp, prompts)
                        for i, t in enumerate(p) if i > 0])
    t0 = time.time()
    many = gen(llm, [ids[i * 50:i * 50 + 64] for i in range(32)], 64)
    r["decode_tok_s_32"] = round(sum(map(len, many)) / (time.time() - t0), 1)
    del llm
    gc.collect()
    torch.cuda.empty_cache() if device == "cuda" else None
    if compare_eager:
        llm = LLM(**{**common, "enforce_eager": True}, enable_prefix_caching=False, max_num_seqs=8)
        b = gen(llm, prompts, 32)
        r["a_vs_b_exact"] = sum(x == y for x, y in zip(a1, b)) / len(b)
        del llm
        gc.collect()
    ref = reference_logprobs(model_dir, prompts, policy, getattr(torch, dtype), device)
    plain = reference_logprobs(model_dir, prompts, None, getattr(torch, dtype), device)
    err, gap = (got - ref).abs().mean().item(), (got - plain).abs().mean().item()
    r["logprob_err_matched"], r["logprob_err_unquantized"] = round(err, 5), round(gap, 5)
    if not state:  # GDN layers: vLLM's and transformers' kernels differ more than the KV formats
        checks["logprobs_nearer_matched_reference"] = err < TOL_RATIO * gap
    r["ok"] = all(checks.values())
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--work", type=Path, default=Path("/tmp/nvfp4-hybrid-models"))
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the model's dtype (float32: rounding too small to flip a greedy token, "
                         "so cold vs prefix-hit differences are not rounding)")
    ap.add_argument("--gpu-head-dims", action="store_true",
                    help="with --device cpu: the head dims (and so the block plan) of the CUDA run")
    ap.add_argument("--max-num-batched-tokens", type=int, default=128,
                    help="engine A's max_num_batched_tokens; CUDA keeps two batches in flight (async "
                         "scheduling), so 128 there plans the blocks as 256 does on CPU")
    ap.add_argument("--compare-eager", action="store_true",
                    help="also run engine B (eager, no prefix caching) and report A vs B")
    variant = ap.add_mutually_exclusive_group()
    variant.add_argument("--startup-calibration", action="store_true",
                         help="no policy file: the engine calibrates at start-up (module doc)")
    variant.add_argument("--k-perm", action="store_true",
                         help="a random K channel order on every NVFP4-K layer (module doc)")
    a = ap.parse_args()
    chosen = "startup_calibration" if a.startup_calibration else "k_perm" if a.k_perm else "by_type"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # collective_rpc with functions
    results: dict[str, Any] = {}
    for arch in a.arch:
        try:
            results[arch] = check_arch(arch, a.device, a.work, a.compare_eager, a.dtype,
                                       a.gpu_head_dims, a.max_num_batched_tokens, chosen)
        except Exception as e:  # one architecture failing must not hide the others
            results[arch] = {"arch": arch, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        a.out.write_text(json.dumps(results, indent=1))
        print("RESULT", json.dumps({arch: results[arch].get("checks", results[arch])}), flush=True)
        gc.collect()
    ok = all(r["ok"] for r in results.values())
    print("RESULT all ok" if ok else "RESULT FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
