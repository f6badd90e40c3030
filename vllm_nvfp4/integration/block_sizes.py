"""Tokens per block of a hybrid model's full-attention and sliding-window layers.

vLLM (0.32 and 0.33, ``_get_packed_kv_cache_groups`` under a block-outermost layout) packs the
KV-cache groups of a hybrid model into one pool of equal blocks. A block holds the pages of the
full-attention group (all full layers side by side) or those of one sliding-window group; the
sliding layers go as many to a group as fit the full group's pages (at least one), so the block
is ``max(full pages, widest sliding group)`` bytes. Whatever a group leaves empty in its blocks
is lost. With the page sizes of mixed FP8 / NVFP4 layers that loss is large at the block size
the user configured: e.g. 3 NVFP4 + 1 FP8 full layers of 2 x 32 heads have 344 B per token
(8 x 43), and no power-of-two sliding page fills more than 32/43 of their block.

:func:`choose_block_sizes` therefore picks both block sizes (multiples of 16 tokens) from what a
request at ``max_model_len`` takes from the pool, as vLLM counts it when it sizes the cache:
``cdiv(L, full block)`` full blocks and, per sliding group, ``cdiv(T, sliding block) + 1`` with
``T = min(window - 1 + in-flight tokens, L)`` (``SlidingWindowSpec``'s admission bound). Among
the plans within :data:`TOLERANCE` of the least bytes it takes the one with the finest
scheduler granularity (the lcm of the block sizes: prefix-cache hits land on its multiples), then
the configured full block size, then the smallest blocks.

Models with Mamba / Gated-DeltaNet layers (their state pages are vLLM's) get their block size
from vLLM (``Platform._align_hybrid_block_size``): it raises the attention block until one
attention layer's page holds a state page, pads the state page to exactly that page, and vLLM
then gives each state group blocks of the full-attention group's bytes. It asks the backend for
that one-token page; :func:`state_share_bytes_per_token` is ours: the full layers' bytes per token
over the states one of their blocks is to hold, so those blocks hold exactly that many states.
With an FP8 layer's page instead (vLLM's default for our uint8 pages), the tiny Qwen3-Next-style
model (one NVFP4 and one FP8 full layer: 400 B per token; six GDN layers) gets 528-token blocks
of 211,200 B, and each GDN group fills 135,168 B of every block it holds (one state).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from vllm_nvfp4.policy import KVPolicy

#: block sizes (tokens) searched for either kind: multiples of 16 (page planes stay 16-byte
#: aligned, :class:`vllm_nvfp4.layout.KVPageLayout`) up to this
MAX_BLOCK = 256
BLOCK_STEP = 16
#: plans whose request bytes are within this fraction of the least count as equal
TOLERANCE = 0.01


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GroupPlan:
    """How vLLM packs one hybrid model's groups for the given block sizes (tokens).

    ``block_bytes``: one block of the shared pool; ``sliding_groups``: the sliding-window groups
    it forms; ``request_blocks``: the pool blocks one request at ``max_model_len`` reserves."""

    full_block: int
    sliding_block: int
    sliding_groups: int
    block_bytes: int
    request_blocks: int

    @property
    def request_bytes(self) -> int:
        """Bytes of the pool one request at ``max_model_len`` reserves."""
        return self.block_bytes * self.request_blocks

    @property
    def scheduler_block(self) -> int:
        """vLLM's scheduler block size for these groups (the lcm of their block sizes)."""
        return math.lcm(self.full_block, self.sliding_block)


def held_tokens(window: int, max_model_len: int, in_flight_tokens: int) -> int:
    """Tokens vLLM reserves per request for a sliding-window layer (its admission bound)."""
    return min(window - 1 + in_flight_tokens, max_model_len)


def _repeats_per_group(full_layers_per_page: tuple[int, ...], num_split: int) -> int | None:
    """vLLM's split of the ``num_split`` sliding or state layers (one page size): when the full
    layers have several page sizes, as many layers of each (a 1:1 pattern), that count is the
    floor of the layers per group, and the group size minimises padding (ties: larger). None
    otherwise: the sliding / state layers are a state bucket (split only by what fits a block)."""
    counts = set(full_layers_per_page)
    if len(full_layers_per_page) < 2 or len(counts) != 1:
        return None
    (floor,) = counts
    values = (floor, num_split)
    return min(range(floor, max(values) + 1),
               key=lambda d: (sum((d - x % d) % d for x in values), -d))


def plan_groups(full_bytes_per_token: tuple[int, ...], sliding_bytes_per_token: int,
                num_sliding: int, window: int, full_block: int, sliding_block: int,
                max_model_len: int, in_flight_tokens: int) -> GroupPlan:
    """The :class:`GroupPlan` of one full-attention bucket (its layers' bytes per token, each
    layer's K + V) and ``num_sliding`` sliding layers of ``sliding_bytes_per_token`` each."""
    full_page = full_block * sum(full_bytes_per_token)
    sliding_page = sliding_block * sliding_bytes_per_token
    per_page: dict[int, int] = {}
    for b in full_bytes_per_token:
        per_page[b] = per_page.get(b, 0) + 1
    repeats = _repeats_per_group(tuple(per_page.values()), num_sliding)
    if repeats is None:  # a state bucket: as many to a group as fit the block
        per_group = max(max(full_page, sliding_page) // sliding_page, 1)
        groups = _cdiv(num_sliding, per_group)
    else:
        groups = _cdiv(num_sliding, repeats)
    block_bytes = max(full_page, _cdiv(num_sliding, groups) * sliding_page)
    held = held_tokens(window, max_model_len, in_flight_tokens)
    blocks = _cdiv(max_model_len, full_block) + groups * (_cdiv(held, sliding_block) + 1)
    return GroupPlan(full_block, sliding_block, groups, block_bytes, blocks)


@functools.lru_cache(maxsize=64)
def choose_block_sizes(full_bytes_per_token: tuple[int, ...], sliding_bytes_per_token: int,
                       num_sliding: int, window: int, configured_block: int,
                       max_model_len: int, in_flight_tokens: int) -> GroupPlan:
    """The plan (module doc) for full layers of ``full_bytes_per_token`` and ``num_sliding``
    sliding layers of one format and ``window``; full blocks from ``configured_block`` up,
    sliding blocks from 16 up, both multiples of 16 and at most :data:`MAX_BLOCK` (or the
    configured size if larger)."""
    if configured_block % BLOCK_STEP:
        raise ValueError(f"block size must be a multiple of {BLOCK_STEP}, got {configured_block}")
    plans = [plan_groups(full_bytes_per_token, sliding_bytes_per_token, num_sliding, window,
                         fb, sb, max_model_len, in_flight_tokens)
             for fb in range(configured_block, max(MAX_BLOCK, configured_block) + 1, BLOCK_STEP)
             for sb in range(BLOCK_STEP, MAX_BLOCK + 1, BLOCK_STEP)]
    least = min(p.request_bytes for p in plans)
    near = [p for p in plans if p.request_bytes <= least * (1 + TOLERANCE)]
    return min(near, key=lambda p: (p.scheduler_block, p.full_block != configured_block,
                                    p.full_block, p.sliding_block))


def _layer_bytes(policy: KVPolicy, num_kv_heads: int, head_dim: int) -> list[tuple[str, int, int]]:
    """``(kind, window, bytes per token)`` of each KV layer of ``policy``, K + V, scales
    included."""
    return [(lp.layer_type.kind, lp.layer_type.window or 0,
             num_kv_heads * (lp.k.bytes_per_head(head_dim) + lp.v.bytes_per_head(head_dim)))
            for _, lp in policy.kv_layers()]


def hybrid_plan(policy: KVPolicy, num_kv_heads: int, head_dim: int, configured_block: int,
                max_model_len: int, in_flight_tokens: int) -> Optional[GroupPlan]:
    """:func:`choose_block_sizes` for a policy with full-attention and sliding-window layers,
    the sliding ones of one format pair and window; None for any other policy (one kind of
    layer, or sliding layers that differ: vLLM keeps them in separate groups of the configured
    block size)."""
    layers = _layer_bytes(policy, num_kv_heads, head_dim)
    full = tuple(b for kind, _, b in layers if kind == "full")
    sliding = {(w, b) for kind, w, b in layers if kind == "sliding"}
    if not full or len(sliding) != 1:
        return None
    ((window, per_token),) = sliding
    return choose_block_sizes(full, per_token, len(layers) - len(full), window, configured_block,
                              max_model_len, in_flight_tokens)


def unpackable_sliding_formats(policy: KVPolicy) -> Optional[str]:
    """Why vLLM 0.32 cannot group this policy's sliding-window layers, or None.

    Next to full-attention layers, vLLM packs the sliding layers of several page sizes (K/V
    format pairs) by a repeat pattern that assumes equal numbers of each; in unequal numbers,
    whenever its ``_get_packed_kv_cache_groups`` splits them into more than one group (which
    depends on the block sizes), the pattern drops layers and it fails with a bare
    ``StopIteration``. Every unequal mix is named, also one that would happen to fit one group.
    Returns the format pairs and their layer counts for the error."""
    if not any(lp.layer_type.kind == "full" for _, lp in policy.kv_layers()):
        return None
    pairs: dict[str, list[int]] = {}
    for i, lp in policy.kv_layers():
        if lp.layer_type.kind == "sliding":
            pairs.setdefault(f"k={lp.k},v={lp.v}", []).append(i)
    if len(pairs) < 2 or len({len(layers) for layers in pairs.values()}) == 1:
        return None
    return "; ".join(f"{len(layers)} with {pair} (layers {', '.join(map(str, layers))})"
                     for pair, layers in pairs.items())


def state_share_bytes_per_token(policy: KVPolicy, num_kv_heads: int,
                                head_dim: int) -> Optional[int]:
    """The one-token attention page vLLM is to size a state-layer hybrid's blocks by (module
    doc), for a policy of full-attention layers and layers without KV cache; None for any other.

    One block of the full-attention group is to hold ``k`` state pages: vLLM's layer repeat when
    the full layers have several page sizes in equal counts (vLLM splits the state layers by it;
    at most the number of states), else the state layers spread evenly over as many groups as
    fp8 gets (groups of at most as many states as there are full layers). The page is the full
    layers' bytes per token over ``k``, rounded down (what a block leaves is under ``k`` bytes per
    token)."""
    layers = _layer_bytes(policy, num_kv_heads, head_dim)
    full = [b for kind, _, b in layers if kind == "full"]
    states = sum(1 for t in policy.layer_types if not t.holds_kv)
    if not states or not full or len(full) != len(layers):
        return None
    repeats = _repeats_per_group(tuple(Counter(full).values()), states)
    k = min(repeats, states) if repeats is not None else _cdiv(states, _cdiv(states, len(full)))
    return sum(full) // k


def arithmetic_request_bytes(policy: KVPolicy, num_kv_heads: int, head_dim: int,
                             max_model_len: int, in_flight_tokens: int, block_size: int) -> int:
    """The format arithmetic of one request at ``max_model_len``: what vLLM would reserve for it
    if every page were packed without loss at ``block_size``: each full-attention layer
    ``cdiv(L, block) * block`` tokens, each sliding layer ``(cdiv(T, block) + 1) * block``
    (:func:`held_tokens`), times the layer's bytes per token."""
    total = 0
    for kind, window, per_token in _layer_bytes(policy, num_kv_heads, head_dim):
        if kind == "sliding":
            blocks = _cdiv(held_tokens(window, max_model_len, in_flight_tokens), block_size) + 1
        else:
            blocks = _cdiv(max_model_len, block_size)
        total += blocks * block_size * per_token
    return total
