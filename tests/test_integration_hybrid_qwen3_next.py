"""``LLM(kv_cache_dtype="nvfp4_mixed")`` on CPU (vLLM 0.32) with the tiny Qwen3-Next-style hybrid.

The model (:func:`vllm_nvfp4.testing.hybrid_models.build_tiny_hybrid` ``"qwen3_next"``): 8 layers,
Gated DeltaNet on 0-2 and 4-6 (their state is vLLM's), full attention on 3 and 7 (2 KV heads,
head_dim 64), MoE. The policy is written into the model directory by type
(``full:nvfp4,7:fp8``).

bfloat16, not float32 as the other hybrid tests: vLLM's CPU GDN kernel
(``model_executor/layers/mamba/ops/cpu/gdn_attention.py``) asserts bfloat16 and a float32 engine
fails at its first forward. The CPU build needs nothing like the CUDA check's
``gdn_prefill_backend: triton``: off CUDA vLLM runs its CPU GDN kernel whatever is asked.

Two engines (and the same two with vLLM's own ``auto`` cache, for the prefix prompts only):

* ``main``  - prefix caching on: vLLM caches the GDN state at block boundaries (its
              ``mamba_cache_mode="align"``; the block is vLLM's alignment of attention and
              state pages, :mod:`vllm_nvfp4.integration.state_alignment`), so the prefix prompts
              share :data:`PREFIX` tokens, more than a block: greedy twice and one by one,
              prefix hits, the KV-cache groups as the worker allocated them;
* ``plain`` - prefix caching off, prefill chunks of that block size, 4096 tokens per request:
              the prefix prompts' cold tokens over the same chunk boundary as the cold prompt of
              ``main`` (in bfloat16 another boundary changes the rounding, and this random model's
              last greedy tokens with it), and the KV capacity.

Prompt log-probs are not compared with transformers: the random model's logits are so large that
bfloat16 rounding alone (transformers' own bfloat16 against its float32 run) moves them more than
the KV formats do (the fake-quantized against the plain reference; numbers in docs/HYBRID.md),
so no tolerance tells the formats apart.
"""

from __future__ import annotations

import gc
import inspect
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engine_helpers import engine, generate, tiny_hybrid_with_policy, token_ids

pytestmark = pytest.mark.vllm

KV_BYTES = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) << 30  # conftest sets 1 GiB
HEADS, DIM = 2, 64
NEW = 8  # greedy tokens per prompt
LONG = 4096  # the plain engine's max_model_len: the cache that grows dominates, as in serving
#: tokens the prefix prompts share (more than vLLM's Mamba-aligned block) and their own after it
PREFIX, OWN = 560, 12


def _state_pages(worker: Any) -> dict[str, dict[str, int]]:
    """In the worker, per GDN layer: the page vLLM allocated for it, the page its own
    ``get_kv_cache_spec`` asks for, the state bytes in a page and the state blocks a request
    at ``max_model_len`` holds."""
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    runner = worker.model_runner
    vc, ctx = runner.vllm_config, runner.compilation_config.static_forward_context
    out = {}
    for group in runner.kv_cache_config.kv_cache_groups:
        specs = group.kv_cache_spec
        specs = (specs.kv_cache_specs if isinstance(specs, UniformTypeKVCacheSpecs)
                 else {n: specs for n in group.layer_names})
        for name, spec in specs.items():
            if isinstance(spec, MambaSpec):
                out[name] = {"page": spec.page_size_bytes,
                             "own_page": ctx[name].get_kv_cache_spec(vc).page_size_bytes,
                             "state": spec.real_page_size_bytes,
                             "blocks": spec.max_memory_usage_bytes(vc) // spec.page_size_bytes}
    return out


def _report(llm: Any) -> dict[str, Any]:
    from vllm_nvfp4.testing.kv_report import kv_cache_report

    return {**llm.collective_rpc(kv_cache_report)[0], "states": llm.collective_rpc(_state_pages)[0],
            "prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
            "mamba_cache_mode": llm.llm_engine.vllm_config.cache_config.mamba_cache_mode}


def _run(model_dir: Path) -> dict[str, Any]:
    llm = engine(model_dir, dtype="bfloat16", enable_prefix_caching=True, max_model_len=1024)
    ids = llm.get_tokenizer()(inspect.getsource(textwrap))["input_ids"]
    prompts = {"short": [ids[1200 + 100 * i:1200 + 100 * i + 100 + 4 * i] for i in range(3)],
               "prefix": [ids[:PREFIX] + ids[2000 + 30 * i:2000 + 30 * i + OWN] for i in range(3)]}
    prefix_outs = generate(llm, prompts["prefix"], NEW, one_by_one=True)
    main = {"short": token_ids(generate(llm, prompts["short"], NEW)),
            "short_again": token_ids(generate(llm, prompts["short"], NEW)),
            "short_single": token_ids(generate(llm, prompts["short"][:2], NEW, one_by_one=True)),
            "prefix": token_ids(prefix_outs), "prefix_hits": [o.num_cached_tokens for o in prefix_outs],
            "report": _report(llm)}
    del llm
    gc.collect()
    block = main["report"]["configured_block_size"]
    llm = engine(model_dir, dtype="bfloat16", enable_prefix_caching=False, max_model_len=LONG,
                 max_num_batched_tokens=block)
    plain = {"short": token_ids(generate(llm, prompts["short"], NEW)),
             "prefix": token_ids(generate(llm, prompts["prefix"], NEW, one_by_one=True)),
             "report": _report(llm)}
    del llm
    gc.collect()
    return {"prompts": prompts, "main": main, "plain": plain}


def _auto_tokens(model_dir: Path, prompts: dict[str, list[list[int]]]) -> dict[str, Any]:
    """The greedy tokens of the short prompts (batched) and the prefix prompts (one by one) with
    vLLM's own bfloat16 cache (``auto``), in the two engines of :func:`_run`: whether vLLM's CPU
    build itself gives the same tokens in both on this machine (its bfloat16 GDN and attention
    kernels round by the chunking on some CPUs)."""
    out = {}
    llm = engine(model_dir, dtype="bfloat16", kv_cache_dtype="auto", enable_prefix_caching=True,
                 max_model_len=1024)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    out["main"] = {"short": token_ids(generate(llm, prompts["short"], NEW)),
                   "prefix": token_ids(generate(llm, prompts["prefix"], NEW, one_by_one=True))}
    del llm
    gc.collect()
    llm = engine(model_dir, dtype="bfloat16", kv_cache_dtype="auto", enable_prefix_caching=False,
                 max_model_len=LONG, max_num_batched_tokens=block)
    out["plain"] = {"short": token_ids(generate(llm, prompts["short"], NEW)),
                    "prefix": token_ids(generate(llm, prompts["prefix"], NEW, one_by_one=True))}
    del llm
    gc.collect()
    return out


def _skip_unless_auto_agrees(runs: dict[str, Any], kind: str) -> None:
    """Skip where vLLM's own bfloat16 cache gives other ``kind`` tokens in the two engines."""
    auto = runs["auto"]
    if auto["main"][kind] != auto["plain"][kind]:
        pytest.skip(f"vLLM's own bfloat16 cache gives other {kind} tokens in the two engines on "
                    f"this CPU too ({auto['main'][kind]} vs {auto['plain'][kind]}): its kernels "
                    "round by the chunking here, so the tokens say nothing about the KV formats")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model_dir, policy = tiny_hybrid_with_policy("qwen3_next",
                                                tmp_path_factory.mktemp("qn") / "qwen3_next")
    out = {"policy": policy, **_run(model_dir)}
    out["auto"] = _auto_tokens(model_dir, out["prompts"])
    return out


def _layer(name: str) -> int:
    return int(name.split(".")[2])


def test_greedy_generation_is_deterministic_and_batch_independent(runs):
    main = runs["main"]
    assert main["short"] == main["short_again"]
    assert main["short"][:2] == main["short_single"]
    assert len({tuple(t) for t in main["short"]}) == len(main["short"])


def test_chunking_and_prefix_caching_do_not_change_the_tokens(runs):
    """The engine without prefix caching, prefilling one block per step, gives the short
    prompts the same tokens."""
    _skip_unless_auto_agrees(runs, "short")
    assert runs["main"]["short"] == runs["plain"]["short"]


def test_prefix_caching_gives_the_cold_tokens(runs):
    """vLLM's CPU build caches this hybrid's prefixes (GDN state in ``align`` mode): the second
    and third prefix prompts hit the shared prefix down to the block, and every prefix prompt
    gets the tokens the engine without prefix caching gives it."""
    main, plain = runs["main"], runs["plain"]
    assert main["report"]["prefix_caching"] and main["report"]["mamba_cache_mode"] == "align"
    block = main["report"]["configured_block_size"]
    hit = PREFIX // block * block
    print(f"prefix cache hits {main['prefix_hits']}, block {block}")
    assert hit > 0 and main["prefix_hits"] == [0, hit, hit]
    assert not plain["report"]["prefix_caching"]
    _skip_unless_auto_agrees(runs, "prefix")
    assert main["prefix"] == plain["prefix"]


def test_gdn_layers_are_vllms_and_the_full_layers_ours(runs):
    """The GDN layers sit in vLLM's Mamba groups with the page their own spec asks for, and no
    impl of ours; the two full-attention layers form one group served by our impl, each layer in
    the formats of its policy row and its page the formats' bytes."""
    from vllm_nvfp4.layout import KVPageLayout

    report, policy = runs["main"]["report"], runs["policy"]
    gdn = {i for i, t in enumerate(policy.layer_types) if t.kind == "none"}
    full = {i for i, _ in policy.kv_layers()}
    assert gdn == {0, 1, 2, 4, 5, 6} and full == {3, 7}
    by_kind: dict[str, set[int]] = {}
    for g in report["groups"]:
        by_kind.setdefault(g["kind"], set()).update(_layer(n) for n in g["layer_pages"])
    assert by_kind == {"MambaSpec": gdn, "FullAttentionSpec": full}
    assert {_layer(n) for n in report["states"]} == gdn
    assert all(s["page"] == s["own_page"] for s in report["states"].values())
    assert {_layer(n) for n in report["impls"]} == full
    (group,) = [g for g in report["groups"] if g["kind"] == "FullAttentionSpec"]
    block = group["block_size"]
    assert block == report["configured_block_size"]
    for name, impl in report["impls"].items():
        row = policy.layers[_layer(name)]
        assert impl["impl"] == "Nvfp4MixedImpl" and impl["formats"] == (row.k, row.v)
        assert impl["block_size"] == block and impl["window"] is None and not impl["sinks"]
        assert group["layer_pages"][name] == KVPageLayout(HEADS, DIM, block, row.k, row.v).page_bytes
    assert group["page_bytes"] == block * policy.kv_bytes_per_token(HEADS, DIM, ("full",))
    assert report["num_blocks"] == KV_BYTES // report["block_bytes"]


def test_state_pages_fill_the_blocks_and_capacity_is_the_arithmetic(runs):
    """Under both Mamba cache modes the full-attention group is the block and every GDN group
    fills it with whole (padded) states: vLLM's state pages differ from the states only by its
    16-token rounding of the block. At 4096 tokens per request vLLM's KV capacity is >= 0.95x the
    arithmetic: the full layers' formats at the configured block
    (:func:`arithmetic_request_bytes`) plus the GDN states a request holds, unpadded."""
    from engine_helpers import BLOCK
    from vllm_nvfp4.integration.block_sizes import arithmetic_request_bytes

    policy = runs["policy"]
    for run in ("main", "plain"):
        report = runs[run]["report"]
        block = report["configured_block_size"]
        for g in report["groups"]:
            if g["kind"] == "MambaSpec":
                assert g["page_bytes"] == report["block_bytes"], (run, g)
        for s in report["states"].values():
            assert s["state"] <= s["page"] < s["state"] + BLOCK * s["page"] // block, (run, s)
    report = runs["plain"]["report"]
    needed = arithmetic_request_bytes(policy, HEADS, DIM, LONG, report["max_in_flight_tokens"],
                                      BLOCK) + sum(s["state"] * s["blocks"]
                                                   for s in report["states"].values())
    ratio = report["kv_cache_size_tokens"] / (KV_BYTES / needed * LONG)
    print(f"KV capacity {report['kv_cache_size_tokens']} tokens at {LONG} per request = "
          f"{ratio:.3f}x the arithmetic of {policy.to_compact()}; block {report['block_bytes']} B, "
          f"groups {[(g['kind'], g['block_size'], g['page_bytes']) for g in report['groups']]}")
    assert ratio >= 0.95
