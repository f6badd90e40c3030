#!/usr/bin/env python3
"""End-to-end check of ``kv_cache_dtype="nvfp4_mixed"`` on a CUDA GPU (SM90 or newer) with real vLLM.

One tiny random fp16 Llama (8 layers, 8/2 heads, head_dim 128, q/k gain 0.5) with a calibrated
mixed policy that has all four K/V format pairs. fp16 and the mild q/k gain keep the random model from amplifying rounding noise
(with bf16 and gain 2 a 0.4% difference flips NVFP4 roundings and whole outputs diverge, which
would make every comparison below meaningless).
Engine A runs as users run it: CUDA graphs on (default compilation), prefix caching on, chunked
prefill (``max_num_batched_tokens=512``), an explicit 2 GiB KV cache. Engine B is the plain
baseline: eager, no prefix caching, no chunking. Checks:

* our backend and impl serve every layer; CUDA graphs are enabled; one KV-cache group;
* KV capacity == 2 GiB // (block_size * policy.kv_bytes_per_token) blocks;
* greedy decoding is deterministic (CUDA-graph replays) and a prefix-cache hit gives the same
  tokens as the cold request;
* prompt log-probs (short prompts and a long one that A prefills in chunks) are nearer to
  transformers + K/V fake-quantized per layer with the same policy than to the unquantized model
  or an all-FP8 policy (by ``TOL_RATIO``);
* the log-probs of the tokens A generated (decode under full CUDA graphs) agree with engine B's
  eager prefill of the same sequences (teacher-forced, so no divergence cascade);
* greedy outputs of A vs B are reported (exact-match rate, first divergence), not checked:
  GEMMs of different batch shapes may flip a near-tie;
* decode throughput of 64 sequences (informative).

Writes ``--out`` JSON and prints ``RESULT {...}``; exit 0 when every hard check passed.
``--device cpu --quick`` runs the same code path on a CPU build of vLLM (a dry run of the script;
the CUDA-graph check then fails by design).
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

KV_BYTES = 2 << 30
DEVICE = "cuda"
#: largest error vs the matched reference, as a fraction of the distance to the unquantized one;
#: rounding flips amplified by the random model set the floor, not the kernels
TOL_RATIO = 0.75


def reference_logprobs(model_dir: Path, prompts: list[list[int]], policy: Any) -> torch.Tensor:
    from vllm_nvfp4.testing.reference import reference_logprobs as reference

    return reference(model_dir, prompts, policy, torch.float16, DEVICE)


def worker_report(worker: Any) -> dict:
    runner = worker.model_runner
    impls = {type(layer.impl).__name__ for layer in
             runner.compilation_config.static_forward_context.values() if hasattr(layer, "impl")}
    groups = [type(g.kv_cache_spec).__name__ for g in runner.kv_cache_config.kv_cache_groups]
    return {"impls": sorted(impls), "groups": groups}


def greedy(n: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def gen(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(a, b)]
    return {"exact": sum(f is None for f in first), "of": len(a),
            "first_divergence": [f for f in first if f is not None]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/nvfp4-tiny-h128"))
    ap.add_argument("--out", type=Path, default=Path("integration_check.json"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="fewer/shorter prompts (CPU dry run)")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    from vllm_nvfp4.testing.check_policy import POLICY, calibrated_policy

    q = 2 if a.quick else 1  # shrink factor
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # collective_rpc with functions
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
                           "policy": POLICY}
    checks: dict[str, bool] = {}
    t0 = time.time()

    def save() -> None:  # after every phase, so a timeout still leaves the partial results
        a.out.write_text(json.dumps({**res, "checks": checks}, indent=1))

    from vllm_nvfp4.policy import KVPolicy
    from vllm_nvfp4.testing.models import build_tiny_llama

    model_dir = build_tiny_llama(a.model_dir, num_layers=8, hidden=512 // q, heads=8, kv_heads=2,
                                 head_dim=128 // q, dtype="float16", max_pos=8192, qk_gain=0.5)
    policy_dict = calibrated_policy(model_dir, DEVICE)
    (model_dir / "nvfp4_policy.json").write_text(json.dumps(policy_dict, indent=1))
    policy = KVPolicy.from_dict(policy_dict)
    res["setup_s"] = round(time.time() - t0, 1)
    save()

    import vllm
    from vllm import LLM, SamplingParams

    res["vllm"] = vllm.__version__
    t = time.time()
    llm = LLM(model=str(model_dir), kv_cache_dtype="nvfp4_mixed", max_model_len=8192,
              enable_prefix_caching=True, max_num_batched_tokens=512, max_num_seqs=64,
              kv_cache_memory_bytes=KV_BYTES, gpu_memory_utilization=0.5, seed=0, dtype="float16")
    res["engine_a_start_s"] = round(time.time() - t, 1)
    cfg = llm.llm_engine.vllm_config
    tok = llm.get_tokenizer()
    import inspect
    import json.decoder as src

    text_ids = tok(inspect.getsource(src) * 4)["input_ids"]
    short = [text_ids[97 * i:97 * i + 40 + (i % 7) * 9] for i in range(32 // q)]
    long = [text_ids[100:100 + 3000 // q], text_ids[4000:4000 + 2600 // q]]
    prefix = [text_ids[5000:5600] + text_ids[200 + 50 * i:230 + 50 * i] for i in range(2)]

    res["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
    res["cudagraph_capture_sizes"] = len(cfg.compilation_config.cudagraph_capture_sizes or [])
    checks["cuda_graphs_on"] = "NONE" not in res["cudagraph_mode"] and res["cudagraph_capture_sizes"] > 0
    report = llm.collective_rpc(worker_report)[0]
    res.update(report)
    checks["our_impl_everywhere"] = report["impls"] == ["Nvfp4MixedImpl"]
    checks["one_kv_group"] = len(report["groups"]) == 1
    block = cfg.cache_config.block_size
    per_token = policy.kv_bytes_per_token(num_kv_heads=2, head_dim=128 // q)
    res["kv"] = {"block_size": block, "num_blocks": cfg.cache_config.num_gpu_blocks,
                 "bytes_per_token": per_token, "expected_blocks": KV_BYTES // (block * per_token),
                 "fp8_bytes_per_token": 2 * 8 * 2 * 128 // q}
    checks["kv_capacity_exact"] = res["kv"]["num_blocks"] == res["kv"]["expected_blocks"]

    # Both runs from a cold prefix cache: a run with cache hits prefills fewer tokens, i.e. other
    # GEMM shapes and fp16 roundings, which this random model amplifies.
    llm.reset_prefix_cache()
    a_short = gen(llm, short, 64)
    llm.reset_prefix_cache()
    checks["deterministic"] = gen(llm, short, 64) == a_short
    llm.reset_prefix_cache()
    cold = gen(llm, [prefix[1]], 32)
    llm.reset_prefix_cache()
    gen(llm, [prefix[0]], 8)
    warm_out = llm.generate([{"prompt_token_ids": prefix[1]}], greedy(32), use_tqdm=False)[0]
    res["prefix_cached_tokens"] = warm_out.num_cached_tokens
    checks["prefix_hit_same_tokens"] = (warm_out.num_cached_tokens >= 512 - block
                                        and list(warm_out.outputs[0].token_ids) == cold[0])
    llm.reset_prefix_cache()
    a_long = gen(llm, long, 32)
    lp_prompts = short[:8] + [long[0][:1000 // q]]  # the long one is prefilled in 512-token chunks
    outs = llm.generate([{"prompt_token_ids": p} for p in lp_prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    got = torch.tensor([o.prompt_logprobs[i][t].logprob for o, p in zip(outs, lp_prompts)
                        for i, t in enumerate(p) if i > 0])
    decoded = llm.generate([{"prompt_token_ids": p} for p in short[:8]],
                           SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    graph_seqs = [(p, list(o.outputs[0].token_ids)) for p, o in zip(short[:8], decoded)]
    graph_lps = torch.tensor([lp[t].logprob for o in decoded
                              for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
    many = [text_ids[50 * i:50 * i + 64] for i in range(64 // q)]
    t = time.time()
    n_out = sum(len(x) for x in gen(llm, many, 256 // q))
    res[f"decode_{len(many)}x{256 // q}_tok_per_s"] = round(n_out / (time.time() - t), 1)
    save()
    del llm
    gc.collect()

    err = (got - reference_logprobs(model_dir, lp_prompts, policy)).abs()
    gaps = {name: float((got - reference_logprobs(model_dir, lp_prompts, other)).abs().mean())
            for name, other in (("unquantized", None), ("all_fp8", KVPolicy.from_compact("*:fp8", 8)))}
    res["logprobs"] = {"n": len(got), "err_mean": float(err.mean()), "err_median": float(err.median()),
                       "err_max": float(err.max()), "gap_mean": gaps}
    # Identifies the policy in force: clearly nearer its own reference than any other policy's.
    checks["logprobs_match_reference"] = float(err.mean()) < TOL_RATIO * min(gaps.values())
    save()

    t = time.time()
    llm = LLM(model=str(model_dir), kv_cache_dtype="nvfp4_mixed", max_model_len=8192,
              enable_prefix_caching=False, max_num_batched_tokens=8192, max_num_seqs=64,
              enforce_eager=True, kv_cache_memory_bytes=KV_BYTES, gpu_memory_utilization=0.5, seed=0,
              dtype="float16")
    res["engine_b_start_s"] = round(time.time() - t, 1)
    rescored = llm.generate([{"prompt_token_ids": p + c} for p, c in graph_seqs],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    eager_lps = torch.tensor([o.prompt_logprobs[len(p) + j][t].logprob
                              for o, (p, c) in zip(rescored, graph_seqs) for j, t in enumerate(c)])
    diff = (graph_lps - eager_lps).abs()
    res["graph_decode_vs_eager_prefill"] = {"n": len(diff), "mean": float(diff.mean()),
                                            "max": float(diff.max())}
    checks["graph_decode_matches_eager"] = float(diff.mean()) < TOL_RATIO * min(gaps.values())
    res["graphs_vs_eager_short"] = agreement(a_short, gen(llm, short, 64))
    res["chunked_vs_unchunked_long"] = agreement(a_long, gen(llm, long, 32))
    del llm
    gc.collect()
    res["ok"] = all(checks.values())
    res["total_s"] = round(time.time() - t0, 1)
    save()
    print("RESULT " + json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
