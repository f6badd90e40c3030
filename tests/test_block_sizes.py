"""Block sizes of hybrid models' KV-cache groups (:mod:`vllm_nvfp4.integration.block_sizes`):
vLLM's packing by hand-computed vectors, and the chosen sizes on real model geometries.

The engine tests (``test_integration_hybrid.py``, ``scripts/gpu_hybrid_check.py``) check that
vLLM forms exactly the planned groups."""

from collections import Counter

import pytest

from vllm_nvfp4.integration.block_sizes import (
    GroupPlan,
    arithmetic_request_bytes,
    choose_block_sizes,
    hybrid_plan,
    plan_groups,
    state_share_bytes_per_token,
    unpackable_sliding_formats,
)
from vllm_nvfp4.policy import KVPolicy, LayerType

NV, F8 = 2 * 2 * (16 + 2), 2 * 2 * 32  # bytes per token of one layer, 2 KV heads, head_dim 32
KF8 = 2 * (32 + 16 + 2)  # K FP8, V NVFP4


def test_packing_by_hand():
    """The tiny Gemma 3 (3 NVFP4 + 1 FP8 full layers, 8 FP8 sliding, window 32) at the
    configured block 16: a 5504-byte block (16 x 344) holds two 2048-byte sliding pages, so 4
    sliding groups; a request at 512 tokens with 1024 in flight holds 512 / 16 full blocks and
    per sliding group 512 / 16 + 1."""
    full = (NV, NV, NV, F8)
    assert plan_groups(full, (F8,) * 8, 32, 16, 16, 512, 1024) == GroupPlan(16, 16, 4, 5504, 32 + 4 * 33)
    # 48-token full blocks: 16512 bytes hold all eight 16-token sliding pages (16384) in one group
    assert plan_groups(full, (F8,) * 8, 32, 48, 16, 512, 1024) == GroupPlan(48, 16, 1, 16512, 11 + 33)
    # a sliding page larger than the full pages sets the block; one layer per group
    assert plan_groups(full, (F8,) * 8, 32, 16, 64, 512, 64) == GroupPlan(16, 64, 8, 8192, 32 + 8 * 3)
    # as many FP8 as NVFP4 full layers (2:2): vLLM splits the sliding layers by that repeat
    # pattern (2 per group), although all 4 pages of 1152 bytes would fit one 6400-byte block
    assert plan_groups((NV, NV, F8, F8), (NV,) * 4, 32, 16, 16, 512, 64).sliding_groups == 2


def test_sliding_formats_in_unequal_numbers_by_hand():
    """Sliding layers of two page sizes, 5 NVFP4 and 3 with K FP8 (KF8 = 100 B per token), next
    to 4 NVFP4 full layers (288 B): vLLM keeps them in one group only if the block holds 8 pages
    of the first sliding layer's size; else its pattern (one layer per page size) covers 3 + 3
    of them and it drops the rest (no plan)."""
    full = (NV,) * 4
    mix = (NV, NV, KF8, NV, KF8, NV, KF8, NV)
    # 32-token full pages (9216 B) hold 8 x 1152 (16-token NVFP4 pages): one group of all
    # 8 sliding pages (16 x 660 = 10560 B, the block)
    assert plan_groups(full, mix, 32, 32, 16, 512, 64) == GroupPlan(32, 16, 1, 10560, 16 + 7)
    assert plan_groups(full, mix, 32, 16, 16, 512, 64) is None  # 4608 B: 4 per group, 2 groups
    # the first sliding layer with FP8 K: 8 x 1600 B need 48-token full pages (13824 B)
    first_big = (KF8, NV, NV, KF8, NV, KF8, NV, NV)
    assert plan_groups(full, first_big, 32, 32, 16, 512, 64) is None
    assert plan_groups(full, first_big, 32, 48, 16, 512, 64).sliding_groups == 1
    # 2 + 2 full layers of two sizes: vLLM's repeat pattern leaves an unequal sliding bucket
    # whole at any block size (one group; the block is the larger of both groups' pages)
    assert plan_groups((NV, NV, F8, F8), mix, 32, 16, 16, 512, 64) == GroupPlan(
        16, 16, 1, 10560, 32 + 7)
    # equal numbers of two sizes (4 + 4) are a pattern vLLM splits without loss
    assert plan_groups(full, (NV, KF8) * 4, 32, 16, 16, 512, 64).sliding_groups == 1


def _vllm_packing():
    """vLLM's planning module and a config for its block-outermost packing (BLNHC)."""
    from types import SimpleNamespace

    try:  # vLLM 0.33
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:  # vLLM 0.32
        from vllm.v1.core import kv_cache_utils as planning
    layout = next(x for x in planning.KVCacheLayout if x.name == "BLNHC")
    config = SimpleNamespace(speculative_config=None, cache_config=SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout))
    return planning, layout, config


def _attention_spec(cls, block, per_token, **kw):
    """An attention spec as ours: one head slot of ``per_token`` bytes per token."""
    import torch
    from vllm.v1.kv_cache_interface import KVQuantMode

    return cls(block_size=block, num_kv_heads=1, head_size=16, head_size_v=16,
               dtype=torch.uint8, kv_quant_mode=KVQuantMode.NONE, num_head_slots=1,
               state_content_bytes=per_token, **kw)


def _packed_or_none(planning, config, specs):
    """vLLM's packed groups of ``specs``, or None where its grouping fails or loses layers."""
    try:
        groups = planning._get_packed_kv_cache_groups(config, specs)
    except StopIteration:  # vLLM 0.32: a group of the split bucket came out empty
        return None
    names = [n for g in groups for n in g.layer_names]
    return groups if sorted(names) == sorted(specs) else None


def _sliding_formats(rng, num_sliding: int) -> tuple[int, ...]:
    """Random sliding layers' bytes per token: one size, or two in equal or unequal numbers,
    in a random model order."""
    sizes = [NV, F8, KF8, 144, 256]
    if num_sliding == 1 or rng.random() < 1 / 3:
        return (rng.choice(sizes),) * num_sliding
    a, b = rng.sample(sizes, 2)
    k = num_sliding // 2 if rng.random() < 0.5 else rng.randint(1, num_sliding - 1)
    layers = [a] * k + [b] * (num_sliding - k)
    rng.shuffle(layers)
    return tuple(layers)


def _specs(full, sliding, fb, sb):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs = {f"full.{i}": _attention_spec(FullAttentionSpec, fb, b) for i, b in enumerate(full)}
    specs |= {f"swa.{i}": _attention_spec(SlidingWindowSpec, sb, b, sliding_window=32)
              for i, b in enumerate(sliding)}
    return specs


def _check_plan(planning, layout, config, plan, full, sliding, fb, sb):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = _packed_or_none(planning, config, _specs(full, sliding, fb, sb))
    if plan is None:
        assert groups is None, (full, sliding, fb, sb)
        return
    assert groups is not None, (full, sliding, fb, sb)
    kinds = [type(next(iter(g.kv_cache_spec.kv_cache_specs.values()))) for g in groups]
    assert (kinds.count(FullAttentionSpec), kinds.count(SlidingWindowSpec),
            planning._get_kv_cache_bytes_per_block(groups, layout)) == (
        plan.full_groups, plan.sliding_groups, plan.block_bytes), (full, sliding, fb, sb)


def test_plan_is_what_vllm_packs():
    """:func:`plan_groups` against vLLM's own grouping of the same specs (the layers in model
    order: full ones, then sliding ones) on random geometries, the sliding layers of one or two
    formats in equal or unequal numbers: block bytes and groups of either kind where vLLM groups
    every layer, no plan where it fails or loses layers."""
    import random

    planning, layout, config = _vllm_packing()
    rng = random.Random(0)
    checked, failing = 0, 0
    while checked < 300:
        full = tuple(rng.choice([NV, F8, 144, 256]) for _ in range(rng.randint(1, 8)))
        sliding = _sliding_formats(rng, rng.randint(1, 20))
        fb, sb = rng.randrange(16, 129, 16), rng.randrange(16, 257, 16)
        if len({fb * b for b in full} | {sb * b for b in sliding}) == 1:
            continue  # vLLM does not pack a uniform page size
        plan = plan_groups(full, sliding, 32, fb, sb, 512, 64)
        _check_plan(planning, layout, config, plan, full, sliding, fb, sb)
        failing += plan is None
        checked += 1
    assert failing >= 20  # the geometries reach vLLM's failure often


def test_chosen_block_sizes_keep_every_layer():
    """The block sizes :func:`choose_block_sizes` picks for random geometries with sliding
    layers of unequal format counts: vLLM groups every layer, as planned, one sliding group."""
    import random

    planning, layout, config = _vllm_packing()
    rng = random.Random(1)
    checked = 0
    while checked < 60:
        full = tuple(rng.choice([NV, F8, 144, 256]) for _ in range(rng.randint(1, 6)))
        sliding = _sliding_formats(rng, rng.randint(3, 40))
        if len(set(Counter(sliding).values())) == 1:
            continue
        plan = choose_block_sizes(full, sliding, 32, 16, rng.choice([512, 4096]),
                                  rng.choice([32, 1024]))
        assert plan.sliding_groups == 1, (full, sliding, plan)
        _check_plan(planning, layout, config, plan, full, sliding, plan.full_block,
                    plan.sliding_block)
        checked += 1


def test_state_share_by_hand():
    """The one-token page for Mamba / GDN hybrids: the full layers' bytes per token over the
    states a full-attention block is to hold."""
    gdn, full = LayerType("none"), LayerType("full")
    # the tiny Qwen3-Next (2 heads, head_dim 64: NVFP4 144, FP8 256 B per token): 1 + 1 full
    # layers, a 1:1 repeat that vLLM splits the six GDN layers by: one state per block
    qnext = _policy(([gdn] * 3 + [full]) * 2, "full:nvfp4,7:fp8")
    assert state_share_bytes_per_token(qnext, 2, 64) == 144 + 256
    # Qwen3-Next-80B-shaped (2 heads, head_dim 256; 36 GDN, 12 full, first and last FP8): no
    # repeat pattern, the 36 states over 3 groups as for fp8, 12 to a block
    big = _policy(([gdn] * 3 + [full]) * 12, "full:nvfp4,3:fp8,47:fp8")
    assert state_share_bytes_per_token(big, 2, 256) == (2 * 1024 + 10 * 576) // 12
    # 2 + 2 full layers: vLLM's repeat of 2 layers per page size sets 2 states per block
    two = _policy(([gdn] * 3 + [full]) * 4, "full:nvfp4,11:fp8,15:fp8")
    assert state_share_bytes_per_token(two, 2, 64) == (2 * 144 + 2 * 256) // 2
    # a repeat of 3 (3 + 3 full layers) but 2 states: one group of both
    few = _policy([gdn] * 2 + [full] * 6, "full:nvfp4,5:fp8,6:fp8,7:fp8")
    assert state_share_bytes_per_token(few, 2, 64) == (3 * 144 + 3 * 256) // 2
    # 7 states, 2 full layers of one format: 4 groups (as fp8), at most 2 states each
    odd = _policy([gdn] * 7 + [full] * 2, "full:nvfp4")
    assert state_share_bytes_per_token(odd, 2, 64) == 2 * 144 // 2
    # no state layers, or sliding layers: not ours to size (None)
    assert state_share_bytes_per_token(_policy([full] * 2, "*:nvfp4"), 2, 64) is None
    swa = LayerType("sliding", 32)
    assert state_share_bytes_per_token(_policy([gdn, swa, full], "swa:fp8,full:nvfp4"), 2, 64) is None


def test_state_layers_fill_the_blocks_vllm_packs():
    """With vLLM's alignment of a Mamba / GDN hybrid at that page (attention block raised to
    16 x cdiv(state, 16 x page), state pages padded to block x page), vLLM's own packing on random
    geometries makes the full-attention group the block (never padded), and its state groups,
    as even as vLLM splits them, the largest with as many states as fill that block."""
    import random

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    planning, layout, config = _vllm_packing()
    gdn, full = LayerType("none"), LayerType("full")
    rng = random.Random(0)
    checked = 0
    while checked < 100:
        num_full, num_states = rng.randint(1, 12), rng.randint(1, 40)
        formats = [rng.choice(["fp8", "nvfp4"]) for _ in range(num_full)]
        types = [full] * num_full + [gdn] * num_states
        policy = _policy(types, ",".join(f"{i}:{f}" for i, f in enumerate(formats)))
        heads, dim = rng.choice([1, 2, 4, 8]), rng.choice([64, 128, 256])
        state = rng.randrange(20_000, 4_000_000)
        per_token = state_share_bytes_per_token(policy, heads, dim)
        block = 16 * -(-state // (16 * per_token))
        specs = {f"full.{i}": _attention_spec(FullAttentionSpec, block, heads * (
            lp.k.bytes_per_head(dim) + lp.v.bytes_per_head(dim)))
            for i, lp in policy.kv_layers()}
        specs |= {f"gdn.{i}": MambaSpec(shapes=((state,),), dtypes=(torch.uint8,), block_size=block,
                                        page_size_padded=block * per_token)
                  for i in range(num_states)}
        if len({x.page_size_bytes for x in specs.values()}) == 1:
            continue  # one page size (a single full layer's): vLLM groups it as any dtype
        groups = planning._get_packed_kv_cache_groups(config, specs)
        block_bytes = planning._get_kv_cache_bytes_per_block(groups, layout)
        full_groups = [g for g in groups if g.layer_names[0].startswith("full.")]
        states = sorted(len(g.layer_names) for g in groups if g.layer_names[0].startswith("gdn."))
        full_page = block * policy.kv_bytes_per_token(heads, dim, ("full",))
        assert len(full_groups) == 1 and full_page == block_bytes, (formats, num_states)
        # the largest state group fills the block with the states the page was sized for
        assert states[-1] == full_page // (block * per_token), (formats, num_states)
        assert states[-1] - states[0] <= 1, (formats, num_states)
        checked += 1


def test_choice_minimises_the_reserved_bytes():
    """The chosen plan reserves no more than any other searched one (within the tolerance),
    and prefers the configured block when it is as good."""
    full = (NV, NV, NV, F8)
    best = choose_block_sizes(full, (F8,) * 8, 32, 16, 512, 1024)
    assert (best.full_block, best.sliding_block, best.sliding_groups) == (48, 16, 1)
    others = [plan_groups(full, (F8,) * 8, 32, f, s, 512, 1024).request_bytes
              for f in range(16, 257, 16) for s in range(16, 257, 16)]
    assert best.request_bytes <= 1.01 * min(others)
    # all-FP8 pages of equal size pack exactly at the configured block
    assert choose_block_sizes((F8,) * 4, (F8,) * 8, 32, 16, 512, 1024).full_block == 16
    with pytest.raises(ValueError, match="multiple of 16"):
        choose_block_sizes(full, (F8,) * 8, 32, 24, 512, 1024)


def _policy(types, compact):
    return KVPolicy.from_compact(compact, len(types), layer_types=types)


@pytest.mark.parametrize("name,types,heads,dim", [
    ("gemma-3-27b", ([LayerType("sliding", 1024)] * 5 + [LayerType("full")]) * 10
     + [LayerType("sliding", 1024)] * 2, 16, 128),
    ("gpt-oss-20b", [LayerType("sliding", 128, True), LayerType("full", None, True)] * 12, 8, 64),
    ("gpt-oss-120b", [LayerType("sliding", 128, True), LayerType("full", None, True)] * 18, 8, 64),
])
@pytest.mark.parametrize("length,in_flight", [(32768, 8192), (131072, 2048)])
def test_real_geometries_reserve_the_format_arithmetic(name, types, heads, dim, length, in_flight):
    """Default-rule policies (sliding FP8, first and last full FP8): a request reserves at most
    2% more than the format arithmetic at block 16, where the configured block alone lost 3-9%."""
    full = [i for i, t in enumerate(types) if t.kind == "full"]
    policy = _policy(types, f"swa:fp8,full:nvfp4,{full[0]}:fp8,{full[-1]}:fp8")
    plan = hybrid_plan(policy, heads, dim, 16, length, in_flight)
    arithmetic = arithmetic_request_bytes(policy, heads, dim, length, in_flight, 16)
    assert arithmetic / plan.request_bytes >= 0.98, (name, plan)


def test_arithmetic_and_plan_inputs():
    """:func:`arithmetic_request_bytes` by hand; :func:`hybrid_plan` for full + sliding layers
    of one window in any mix of formats (each sliding layer's bytes in model order)."""
    swa, full = LayerType("sliding", 32), LayerType("full")
    policy = _policy([swa, full, swa], "swa:fp8,full:nvfp4")
    # full: 512 tokens x NV; sliding: min(31 + 64, 512) = 95 -> (6 + 1) blocks of 16, x F8 each
    assert arithmetic_request_bytes(policy, 2, 32, 512, 64, 16) == 512 * NV + 2 * 112 * F8
    assert hybrid_plan(policy, 2, 32, 16, 512, 64) == choose_block_sizes((NV,), (F8, F8), 32, 16, 512, 64)
    assert hybrid_plan(_policy([full, full], "*:nvfp4"), 2, 32, 16, 512, 64) is None
    mixed = _policy([swa, full, swa, swa], "swa:fp8,full:nvfp4,2:nvfp4")
    assert hybrid_plan(mixed, 2, 32, 16, 512, 64) == choose_block_sizes(
        (NV,), (F8, NV, F8), 32, 16, 512, 64)
    two_windows = _policy([swa, full, LayerType("sliding", 64)], "swa:fp8,full:nvfp4")
    assert hybrid_plan(two_windows, 2, 32, 16, 512, 64) is None


@pytest.mark.parametrize("types,dim,compact", [
    ([LayerType("sliding", 32), LayerType("sliding", 32), LayerType("full")] * 4, 32,
     "swa:fp8,full:nvfp4"),  # the tiny Gemma 3
    ([LayerType("sliding", 32, True), LayerType("full", None, True)] * 6, 64,
     "swa:fp8,full:nvfp4"),  # the tiny gpt-oss
])
def test_tiny_hybrids_hold_more_than_fp8(types, dim, compact):
    """The tiny test models at 4096 tokens per request with 32 in flight (the engine test's
    chunked engine), no full-attention layer in FP8: >= 1.6x what vLLM reserves for fp8 (one
    page size: vLLM's groups of equal layer counts, no padding, so the arithmetic at block 16)."""
    policy = _policy(types, compact)
    fp8 = _policy(types, "*:fp8")
    plan = hybrid_plan(policy, 2, dim, 16, 4096, 32)
    assert arithmetic_request_bytes(fp8, 2, dim, 4096, 32, 16) / plan.request_bytes >= 1.6


GEMMA3_270M = tuple(LayerType() if i % 6 == 5 else LayerType("sliding", 512) for i in range(18))
#: the formats ``tune`` chose for Gemma 3 270M (results/2026-12-01-zeroconfig-tables-cpu)
GEMMA3_270M_TUNE = ("0-1:nvfp4,2:k=fp8,v=nvfp4,3:nvfp4,4:k=fp8,v=nvfp4,5-7:nvfp4,8:k=fp8,v=nvfp4,"
                    "9:nvfp4,10:k=fp8,v=nvfp4,11-17:nvfp4")


@pytest.mark.parametrize("length,in_flight", [(1088, 2048), (4096, 2048), (32768, 8192)])
def test_gemma3_270m_tune_policy_is_planned_in_one_sliding_group(length, in_flight):
    """Gemma 3 270M's ``tune`` policy (1 KV head, head_dim 256; 11 all-NVFP4 and 4 K-FP8
    sliding layers, 3 NVFP4 full layers): one sliding group, a request reserves >= 0.97x its
    format arithmetic."""
    policy = _policy(GEMMA3_270M, GEMMA3_270M_TUNE)
    plan = hybrid_plan(policy, 1, 256, 16, length, in_flight)
    assert (plan.full_groups, plan.sliding_groups) == (1, 1)
    arithmetic = arithmetic_request_bytes(policy, 1, 256, length, in_flight, 16)
    assert arithmetic / plan.request_bytes >= 0.97, plan


def test_unplanned_sliding_format_mixes_are_named():
    """An unequal sliding mix that :func:`hybrid_plan` does not plan (beside layers without KV
    cache, or a second window) is named for the start-up error; planned mixes, equal numbers
    (vLLM's 1:1 pattern) and models without full layers pass."""
    assert unpackable_sliding_formats(_policy(GEMMA3_270M, GEMMA3_270M_TUNE)) is None
    assert unpackable_sliding_formats(_policy(GEMMA3_270M, "swa:fp8,full:nvfp4,17:fp8")) is None
    swa, gdn = LayerType("sliding", 32), LayerType("none")
    state = (LayerType(), gdn, *[swa] * 4)
    assert unpackable_sliding_formats(_policy(state, "2:k=fp8,v=nvfp4,*:nvfp4")) == (
        "1 with k=fp8,v=nvfp4 (window 32: layers 2); 3 with k=nvfp4,v=nvfp4 (window 32: layers 3, 4, 5)")
    assert unpackable_sliding_formats(_policy(state, "2-3:fp8,*:nvfp4")) is None
    # two windows: the counts of each window's bucket matter (2 FP8 + 1 NVFP4 in window 32)
    windows = (LayerType(), swa, swa, swa, LayerType("sliding", 64))
    assert unpackable_sliding_formats(_policy(windows, "1-2:fp8,*:nvfp4")) is not None
    assert unpackable_sliding_formats(_policy(windows, "1-3:fp8,*:nvfp4")) is None
    mistral = (LayerType("sliding", 64),) * 6
    assert unpackable_sliding_formats(_policy(mistral, "0:fp8,*:nvfp4")) is None
