#!/usr/bin/env python3
"""``kv_cache_dtype="nvfp4_mixed"`` with the vLLM features that move or reuse KV blocks, on CUDA.

The target is the tiny random fp16 Llama of ``gpu_integration_check.py`` (8 layers, 8/2 heads,
head_dim 128) with its calibrated mixed policy; engines run eager (no CUDA-graph capture) to keep
the whole check short (``gpu_compat_check.sh`` stops it after ``TIMEOUT_S``). Phases
(``--phases``, default all but ``pp``):

* ``eagle``  EAGLE on the repetitive variant of the tiny Llama (tied LM head, residual branches
             doubled: ``vllm_nvfp4.testing.spec_models``, as in the CPU test) with a one-layer head that mostly
             proposes the last token again (``echo_eagle``): greedy nvfp4_mixed + EAGLE ==
             greedy nvfp4_mixed without speculation; acceptance rate against the same head with
             ``kv_cache_dtype="fp8"``.
* ``draft``  ``method="draft_model"`` with a copy of the target as the draft: same checks; and with
             an all-FP8 target policy (the draft's own FP8 rule then matches it) >= 90% accepted.
Speculation phases run float32 engines on CUDA (see ``spec_phase``).
* ``ngram``  ngram speculation on the repetitive model: same checks.
* ``offload`` native CPU offloading (``kv_offloading_size``, OffloadingConnector) with a GPU cache
             of 96 blocks: 64 requests share 4 long prefixes, so blocks are evicted to CPU and
             loaded back; greedy tokens and the generated tokens' log-probs must equal an engine
             with a cache large enough to keep everything.
* ``pd``     disaggregated prefill through vLLM's ExampleConnector (shared storage): a producer
             engine stores the prompts' blocks, a fresh consumer engine loads them; 64 requests,
             tokens and log-probs equal to an engine without connector.
* ``pp``     ``pipeline_parallel_size=2`` (needs 2 GPUs): greedy tokens equal PP=1.

Writes ``--out`` JSON after every phase and prints ``RESULT {...}``; exit 0 when every check passed.
``--device cpu`` runs the same code on a CPU build of vLLM (float32, block size 32 for vLLM's CPU
fp8 cache; a dry run of the script: ``offload`` needs CUDA and fails there by design).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
NUM_SPEC = 3
LOGPROB_TOL = 2e-2  # fp16 model: generated-token log-probs of two engines of the same cache
DEVICE = "cuda"
SPEC_DTYPE = "float32"


def target_model(root: Path) -> Path:
    """gpu_integration_check's model and calibrated policy (nvfp4_policy.json beside it)."""
    from vllm_nvfp4.testing.check_policy import calibrated_policy
    from vllm_nvfp4.testing.models import build_tiny_llama

    model = build_tiny_llama(root / "target", num_layers=8, hidden=512, heads=8, kv_heads=2,
                             head_dim=128, dtype="float16", max_pos=8192, qk_gain=0.5)
    if not (model / "nvfp4_policy.json").exists():
        (model / "nvfp4_policy.json").write_text(json.dumps(calibrated_policy(model, DEVICE)))
    return model


def all_fp8_policy(path: Path, num_layers: int) -> Path:
    """A policy file that stores every layer's K and V in FP8."""
    path.write_text(json.dumps({"format": "vllm-nvfp4-policy", "version": 1, "num_layers": num_layers,
                                "layers": [{"index": i, "k": "fp8", "v": "fp8"}
                                           for i in range(num_layers)]}))
    return path


def repetitive(work: Path) -> Path:
    """The repetitive tiny Llama of the CPU test (built once under ``work``)."""
    head_dim = 64 if DEVICE == "cuda" else 32  # the CUDA kernels need >= 64
    rep = work / f"repetitive-h{head_dim}"
    if not rep.exists():
        from vllm_nvfp4.testing.spec_models import repetitive_llama

        repetitive_llama(rep, head_dim=head_dim)
    return rep


def engine(model: Path, kv_cache_dtype: str, **kwargs: Any) -> Any:
    from vllm import LLM

    cuda = DEVICE == "cuda"
    args = dict(model=str(model), kv_cache_dtype=kv_cache_dtype,
                # bf16 on CUDA: vLLM's own fp8 baseline (FA3) writes bf16 output only
                dtype="bfloat16" if cuda else "float32", block_size=16 if cuda else 32,
                max_model_len=4096, max_num_seqs=32, enforce_eager=True, seed=0,
                disable_log_stats=False)
    if cuda:
        args["gpu_memory_utilization"] = 0.05  # ~7 GiB of an H200: a phase runs up to 3 engines
    args.update(kwargs)
    return LLM(**args)


def run(llm: Any, prompts: list[list[int]], n: int) -> dict[str, Any]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    res: dict[str, Any] = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                     for o in outs]}
    metrics = {m.name: m for m in llm.get_metrics()}
    if "vllm:spec_decode_num_draft_tokens" in metrics:
        drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
        accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
        res.update(drafted=drafted, accepted=accepted, acceptance=accepted / max(1, drafted))
    return res


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()  # frees the engine core's GPU memory now
    del llm
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def compare(a: dict, b: dict) -> dict[str, Any]:
    """Exact-token agreement and the largest log-prob difference of two runs."""
    same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    diffs = [abs(p - q) for x, y in zip(a["logprobs"], b["logprobs"]) for p, q in zip(x, y)]
    return {"requests": len(a["tokens"]), "same_tokens": same,
            "mismatched_requests": len(a["tokens"]) - same,
            "max_logprob_diff": max(diffs) if diffs else None}


def prompts_from(tok: Any, count: int, length: int, offset: int = 0) -> list[list[int]]:
    import inspect
    import json.decoder as src

    ids = tok(inspect.getsource(src) * 8)["input_ids"]
    return [ids[offset + 53 * i: offset + 53 * i + length + (i % 5) * 7] for i in range(count)]


def spec_phase(model: Path, speculative: dict, prompts: list[list[int]], n: int,
               formats: tuple[str, ...] = ("nvfp4_mixed", "fp8"),
               compare_acceptance: bool = True) -> dict:
    """For nvfp4_mixed and for vLLM's fp8: greedy tokens without and with ``speculative``, and
    the acceptance rate (compared with fp8's by ``acceptance_holds`` unless ``compare_acceptance``
    is false). Engines run in float32 on CUDA: in bf16 a verify step's batched GEMMs
    round differently from one-token decodes and flip near-ties of the random model for every
    cache format; the fp8 engine falls back to bf16 where this vLLM has no fp32 fp8 attention."""
    res: dict[str, Any] = {}
    for kv in formats:
        for dtype in ((SPEC_DTYPE, "bfloat16") if kv == "fp8" and DEVICE == "cuda" else (SPEC_DTYPE,)):
            try:
                kw = {"dtype": dtype} if DEVICE == "cuda" else {}
                llm = engine(model, kv, **kw)
                base = run(llm, prompts, n)
                close(llm)
                llm = engine(model, kv, speculative_config=speculative, **kw)
                spec = run(llm, prompts, n)
                close(llm)
                break
            except Exception as e:  # noqa: BLE001 - recorded; the next dtype is tried
                res[f"{kv}_{dtype}_error"] = f"{type(e).__name__}: {e}"[:500]
        res[kv] = {"dtype": dtype, "vs_non_speculative": compare(spec, base),
                   "acceptance": spec.get("acceptance"), "drafted": spec.get("drafted"),
                   "accepted": spec.get("accepted")}
    if len(formats) < 2:
        return res
    ours, fp8 = res["nvfp4_mixed"], res["fp8"]
    # vLLM's own fp8 cache sets the floor: its verify steps' fp32 GEMMs flip as many near-ties
    res["ok"] = (ours["vs_non_speculative"]["mismatched_requests"]
                 <= fp8["vs_non_speculative"]["mismatched_requests"]
                 and (ours["accepted"] or 0) > 0
                 and (not compare_acceptance or acceptance_holds(ours, fp8)))
    return res


def acceptance_holds(ours: dict, ref: dict) -> bool:
    """``ours`` accepts no fewer drafts than ``ref`` beyond sampling noise: at least ``ref``'s
    rate minus three standard errors of the difference of two binomial rates (counts of drafted
    tokens; ~0.03 at 4,500 drafts each). A higher rate passes: the drafts follow the target's own
    greedy tokens, which differ between cache formats, so a read path that corrupts keys shows as
    fewer accepted drafts, not more."""
    p, q = ours["acceptance"], ref["acceptance"]
    se = (p * (1 - p) / max(ours["drafted"], 1) + q * (1 - q) / max(ref["drafted"], 1)) ** 0.5
    return p >= q - 3 * se


def transfer_phase(model: Path, prompts: list[list[int]], n: int,
                   make_engines: list[Callable[[], Any]]) -> dict:
    """Baseline engine, then each engine of ``make_engines`` on the same prompts (twice)."""
    llm = engine(model, "nvfp4_mixed", enable_prefix_caching=False)
    base = run(llm, prompts, n)
    close(llm)
    res: dict[str, Any] = {}
    for i, make in enumerate(make_engines):
        llm = make()
        first = run(llm, prompts, n)
        second = run(llm, prompts, n)  # the second pass reuses offloaded / stored blocks
        close(llm)
        res[f"engine{i}"] = {"first": compare(first, base), "second": compare(second, base)}
    res["ok"] = all(r[p]["mismatched_requests"] == 0 and r[p]["max_logprob_diff"] <= LOGPROB_TOL
                    for r in res.values() for p in ("first", "second"))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="eagle,draft,ngram,offload,pd")
    ap.add_argument("--work", type=Path, default=Path("/tmp/nvfp4-compat"))
    ap.add_argument("--out", type=Path, default=Path("compat_h200.json"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--spec-prompts", type=int, default=64,
                    help="prompts of the speculative phases (acceptance is a ratio over them)")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    res: dict[str, Any] = {"vllm": vllm.__version__,
                           "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"}
    a.work.mkdir(parents=True, exist_ok=True)
    model = target_model(a.work)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    short = prompts_from(tok, a.spec_prompts, 48)
    repeated = [p * 2 for p in prompts_from(tok, a.spec_prompts, 24)]
    for phase in a.phases.split(","):
        t = time.time()
        try:
            if phase == "eagle":
                from vllm_nvfp4.testing.spec_models import echo_eagle

                rep = repetitive(a.work)
                head = echo_eagle(rep, a.work / "eagle")
                out = spec_phase(rep, {"method": "eagle", "model": str(head),
                                       "num_speculative_tokens": NUM_SPEC}, repeated, 64)
            elif phase == "draft":
                draft = a.work / "draft"
                if not draft.exists():
                    shutil.copytree(model, draft)
                spec = {"method": "draft_model", "model": str(draft),
                        "num_speculative_tokens": NUM_SPEC}
                # the draft stores K/V in FP8 and the mixed target mostly NVFP4, so fewer of its
                # drafts are accepted by design; with an all-FP8 target policy it computes what
                # the target does, so its acceptance must hold against vLLM's fp8
                out = spec_phase(model, spec, short, 64, compare_acceptance=False)
                os.environ["VLLM_NVFP4_POLICY"] = str(all_fp8_policy(a.work / "fp8.json", 8))
                try:
                    out["all_fp8_target"] = spec_phase(model, spec, short, 64,
                                                           ("nvfp4_mixed",))["nvfp4_mixed"]
                finally:
                    del os.environ["VLLM_NVFP4_POLICY"]
                out["ok"] = out["ok"] and acceptance_holds(out["all_fp8_target"], out["fp8"])
            elif phase == "ngram":
                out = spec_phase(repetitive(a.work), {"method": "ngram",
                                                      "num_speculative_tokens": NUM_SPEC,
                                                      "prompt_lookup_min": 2,
                                                      "prompt_lookup_max": 3}, repeated, 64)
            elif phase == "offload":
                # 16 suffixes x 4 prefixes of 25 blocks, interleaved: 64 requests; a 96-block GPU
                # cache (2 running requests of ~27 blocks) evicts each prefix before its reuse
                prefixes = prompts_from(tok, 4, 400, offset=7000)
                prompts = [p + s[:24] for s in prompts_from(tok, 16, 24) for p in prefixes]
                out = transfer_phase(model, prompts, 16, [
                    lambda: engine(model, "nvfp4_mixed", num_gpu_blocks_override=96,
                                   max_model_len=1024,  # 96 blocks must hold one request
                                   max_num_seqs=2, kv_offloading_size=1.0,
                                   kv_offloading_backend="native")])
            elif phase == "pd":
                store = Path(tempfile.mkdtemp(prefix="nvfp4-pd-"))
                conn = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"shared_storage_path": str(store)}}
                prompts = prompts_from(tok, 64, 40, offset=3000)
                out = transfer_phase(model, prompts, 16, [
                    lambda: engine(model, "nvfp4_mixed", kv_transfer_config=conn,
                                   enable_prefix_caching=False),  # producer: stores
                    lambda: engine(model, "nvfp4_mixed", kv_transfer_config=conn,
                                   enable_prefix_caching=False)])  # consumer: loads
                out["stored_prompts"] = len(os.listdir(store))
            elif phase == "pp":
                llm = engine(model, "nvfp4_mixed", distributed_executor_backend="mp")
                base = run(llm, short, 32)
                close(llm)
                llm = engine(model, "nvfp4_mixed", pipeline_parallel_size=2,
                             distributed_executor_backend="mp")
                out = {"vs_pp1": compare(run(llm, short, 32), base)}
                close(llm)
                out["ok"] = out["vs_pp1"]["mismatched_requests"] == 0
            else:
                raise ValueError(f"unknown phase {phase!r}")
        except Exception as e:  # record and go on with the next phase
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        out["seconds"] = round(time.time() - t, 1)
        res[phase] = out
        a.out.write_text(json.dumps(res, indent=1))
        print(f"PHASE {phase} {json.dumps(out)}", flush=True)
    ok = all(res[p].get("ok") for p in a.phases.split(","))
    print("RESULT " + json.dumps({p: res[p].get("ok") for p in a.phases.split(",")}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
