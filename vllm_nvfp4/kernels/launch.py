"""Launch shapes of the paged-attention kernels (:mod:`vllm_nvfp4.kernels.attention`): tiles,
warps, decode splits, pipeline stages and register caps per layout, chosen by timing on Hopper,
and :class:`LaunchShape`, which fixes them for benchmarks and tests.

Every choice derives from host ints (shapes, ``max_seq_len``), never from tensor contents, so a
decode launch is CUDA-graph capturable.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from vllm_nvfp4.formats import KVFormat


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_n: int,
                  device: torch.device, num_warps: int = 1, dim_parts: int = 1) -> int:
    """Split count (a power of 2) from host ints only: the larger of (a) enough programs to fill
    the GPU, ``8 * SMs / num_warps``, but at most 8 splits (beyond that the partial writes and
    the reduce cost more than the extra occupancy gains) - unless 8 splits still leave fewer
    than half that many programs (few sequences x few KV heads), then as many as keep >= 1024
    keys per split or as fill the GPU with >= 128 keys per split, whichever is more (H200, 16
    sequences, 1 warp: 32 splits against 8 took 0.66x / 0.56x the time at head_dim 256 x 2 KV
    heads, 4k / 8k keys, and 16 splits 0.81x at head_dim 512 x 4 KV heads, 4k) - and (b) at
    most ~4096 keys per split; never more splits than tiles, at most 64. With the head dim in
    parts (``dim_parts > 1``, two-warp programs), twice that where the doubled grid still fits
    the SMs at :func:`decode_register_cap`'s 128 registers, eight programs per SM (H200, head_dim
    512, 32 q / 4 KV heads, 16 x 32k: 16 splits 495.6 us against 8 splits 539.4, our FP8 520.0;
    16 x 4k 83.6 against 84.4)."""
    target = 8 * _num_sms(device) // num_warps
    max_splits = min(max(1, -(-max_seq_len // tile_n)), 64)
    programs = num_seqs * num_kv_heads
    if 2 * programs * 8 >= target:
        fill_cap = 8
    else:
        filling = 1
        while programs * filling * 2 <= target and max_seq_len // (filling * 2) >= 128:
            filling *= 2
        fill_cap = max(8, max_seq_len // 1024, filling)
    splits = 1
    while splits * 2 <= max_splits and (
        (programs * splits < target and splits * 2 <= fill_cap)
        or max_seq_len > 4096 * splits
    ):
        splits *= 2
    if dim_parts > 1 and splits * 2 <= max_splits and programs * splits * 2 <= 8 * _num_sms(device):
        splits *= 2
    return splits


#: splits of at most this many keys take ``LaunchShape.short_split_maxnreg``
SHORT_SPLIT_KEYS = 1024
#: splits of at least this many keys take ``LaunchShape.long_split_stages``
LONG_SPLIT_KEYS = 1024
#: the tile loop's software-pipeline stages unless a launch shape sets others. Triton 3.6 spends
#: one stage on the block-table load that the K/V addresses depend on, so 3 stages copy the next
#: tile into the single buffer only after this one is used (no overlap within a program)
DEFAULT_STAGES = 3
#: stages that give the K/V copies a second buffer: the next tile's copy runs during this tile's
#: math (sm_90 compile: 10.5 -> 20.0 KB shared memory per 64-key NVFP4 program). H200, 32 q /
#: 8 KV heads, head_dim 128, one process: NVFP4 K and V 64 x 32k 754.7 -> 709.3 us, 16 x 32k
#: 203.9 -> 191.3, 64 x 4k 119.1 -> 115.9, but 16 x 4k (512 keys per split) 43.1 -> 44.1; NVFP4
#: K / FP8 V 64 x 32k 854.8 -> 814.5; slower with an FP8 K (FP8 / FP8 16 x 32k 258.8 -> 291.5)
PIPELINED_STAGES = 5


def decode_stages(shape: "LaunchShape", keys_per_split: int) -> int:
    """The decode tile loop's pipeline stages for splits of at most ``keys_per_split`` keys:
    ``shape.num_stages``; unset, ``shape.long_split_stages`` where a split holds at least
    :data:`LONG_SPLIT_KEYS` keys; else :data:`DEFAULT_STAGES`."""
    if shape.num_stages:
        return shape.num_stages
    if shape.long_split_stages and keys_per_split >= LONG_SPLIT_KEYS:
        return shape.long_split_stages
    return DEFAULT_STAGES


def decode_register_cap(shape: "LaunchShape", programs: int, keys_per_split: int,
                        device: torch.device) -> Optional[int]:
    """The decode kernel's register cap per thread for a grid of ``programs`` splits of at most
    ``keys_per_split`` keys each: ``shape.maxnreg``; unset, with the head dim in parts
    (``dim_parts > 1``), 128 where the grid holds more programs than fit the SMs uncapped (the
    head_dim-512 NVFP4 decode takes 216 registers: four two-warp programs per SM; capped, it
    spills a few and eight fit; H200, 32 q / 4 KV heads: capped 64 x 4k 293 -> 260 us and
    64 x 32k 2152 -> 1887 us; with fewer programs than fit uncapped the spills only cost,
    16 x 4k 84 -> 92 us, 16 x 32k 554 -> 610 us at 8 splits, which :func:`decode_splits` doubles
    there); else ``shape.short_split_maxnreg`` where a
    split holds at most 1024 keys."""
    if shape.maxnreg:
        return shape.maxnreg
    if shape.dim_parts > 1:
        return 128 if programs > 4 * _num_sms(device) else None
    if keys_per_split <= SHORT_SPLIT_KEYS:
        return shape.short_split_maxnreg
    return None


@dataclasses.dataclass(frozen=True)
class LaunchShape:
    """How :func:`paged_attention` launches its kernels (default: :func:`launch_defaults`).

    ``tile_n``: keys per tile (at least the block size is used); ``num_warps``: warps per program;
    ``query_rows``: prefill rows (query tokens x padded GQA group) per program, a power of 2.
    The rest stay ``None`` in production and are fixed by benchmarks and tests: ``num_splits``,
    the decode split count (default :func:`decode_splits`); ``num_stages``, the software-pipeline
    stages of the whole-tile loop (``tl.range``; default :func:`decode_stages` in decode,
    :data:`DEFAULT_STAGES` in prefill); ``long_split_stages``, the stages where each decode split
    holds at least :data:`LONG_SPLIT_KEYS` keys;
    ``maxnreg``, the decode kernel's register cap per thread (Triton's ``maxnreg``; default
    :func:`decode_register_cap`); ``short_split_maxnreg``, the cap where each decode split holds
    at most :data:`SHORT_SPLIT_KEYS` keys (a short loop gains more from the registers ptxas then
    spends on scheduling than from more programs per SM).
    Code variants of the attention core (:func:`_attend_keys`): ``hoist_query`` converts the
    query operands to the MMA layout once before the tile loop; ``fold_k_scales`` multiplies
    each NVFP4 K plane by its block scales in fp16 (exact) so that one chained dot replaces a
    dot and a scaled fp32 sum per chunk; ``fold_v_scales`` does the same for the NVFP4 V planes
    (instead of scaling P per chunk, which converts each scaled P through shared memory);
    ``dim_parts`` (a power of 2, at most ``num_warps``, dividing head_dim / 64) cuts the head
    dim into parts, each taken by its own warps: every operand gets a leading part dimension
    (batched MMAs, one part per warp), the parts' partial scores are summed across the warps
    once per tile, and each warp holds only its part's output accumulators;
    ``lazy_rescale`` rescales the output accumulators only in tiles that raise the running max
    of some query column (exact: the same products, skipped where the factor is 1);
    ``key0_in_loop`` (with ``key0_shift``) corrects the key at position 0 in every whole tile of
    the pipelined loop instead of running position 0's tile alone first (the same arithmetic);
    ``key0_after_loop`` instead runs the loop as without the correction and then moves position
    0's softmax weight to its corrected logit from one K and one V row;
    ``rot_rows`` (with ``rot_center``): the rows of the correction's cos / sin tables
    (:func:`rot_rows`).
    """

    tile_n: int
    num_warps: int
    query_rows: int = 16
    num_splits: Optional[int] = None
    num_stages: Optional[int] = None
    maxnreg: Optional[int] = None
    short_split_maxnreg: Optional[int] = None
    long_split_stages: Optional[int] = None
    hoist_query: bool = False
    fold_k_scales: bool = False
    fold_v_scales: bool = False
    dim_parts: int = 1
    lazy_rescale: bool = False
    key0_in_loop: bool = False
    key0_after_loop: bool = False
    rot_rows: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.query_rows < 1 or self.query_rows & (self.query_rows - 1):
            raise ValueError(f"query_rows must be a power of 2, got {self.query_rows}")
        parts = self.dim_parts
        if parts < 1 or parts & (parts - 1) or parts > self.num_warps:
            raise ValueError(f"dim_parts must be a power of 2 <= num_warps, got {parts}")
        if self.key0_in_loop and self.key0_after_loop:
            raise ValueError("key0_in_loop and key0_after_loop are two ways of one correction: "
                             "set at most one")
        rows = self.rot_rows
        if rows is not None and (rows < 1 or rows & (rows - 1)):
            raise ValueError(f"rot_rows must be a power of 2, got {rows}")


def rot_rows(shape: "LaunchShape", tile_n: int, pairs: Optional[int] = None) -> int:
    """Rows of the rotating-center correction's cos / sin tables (an FP16 MMA operand ``[rows,
    pairs]`` held in registers for the whole tile loop) for ``tile_n``-key tiles and ``pairs``
    corrected RoPE pairs per KV head (``None``: all, ``head_dim / 2``): ``shape.rot_rows``, else
    the whole tile with more than one warp or at most 16 pairs, 16 rows otherwise; at most
    ``tile_n``, at least ``tile_n / 4`` (a tile stacks up to 4 row blocks, each turned once more)
    and 16. The sm_90 compile (``compile_sm90.py --splits 8 --rot-center [--rot-pairs K]``,
    Triton 3.6, head_dim 128, 64-key tiles), warp-instructions per token-head of the tile loop:
    NVFP4 K and V (one warp, 190 registers without) 23.0 -> 28.5 with all 64 pairs at 16 rows
    and 255 registers (32 rows spill: 119 spill instructions in the loop, 64 spill far more);
    with 8 / 16 pairs 24.6 / 24.8 at 16 rows, 23.3 / 23.6 at 64 rows (226 / 252 registers).
    Under the 184-register cap of short splits (``decode_register_cap``; stages 3): 23.1 without
    (11 spill instructions), 31.2 with all pairs (187 spills), 23.8 / 24.1 with 8 / 16 pairs at 64
    rows (8 / 31 spills), 26.0 / 25.8 at 16 rows. FP8 K and V (two warps, 122 registers
    without) 16.7 -> 19.9 with all pairs at 64 rows (229 registers), 22.8 at 32, 27.5 at 16; with
    8 / 16 pairs 17.0 / 17.4 at 64 rows (128 / 160 registers)."""
    whole = shape.num_warps > 1 or (pairs is not None and pairs <= 16)
    rows = shape.rot_rows or (tile_n if whole else 16)
    return min(tile_n, max(rows, tile_n // 4, 16))


@dataclasses.dataclass(frozen=True)
class RotCenter:
    """The rotating center of :func:`attention.paged_attention` (``rot_center``) on ``k`` RoPE
    pairs per KV head: K stored as ``k - R(p) b_k`` where ``b_k`` is ``b`` with every pair but
    the selected ones zero (pair ``i`` = dims ``(i, i + head_dim / 2)``, turned by ``theta_i p``),
    so only the selected pairs take a logit correction and its cost scales with ``k`` (the other
    pairs' offset, if any, is a constant the stored keys keep: no kernel term).

    ``idx`` int32 ``[kv_heads, k]``: each head's pairs, any order, no repeats; ``b`` FP32
    ``[kv_heads, 2, k]``: ``b[h, idx]`` and ``b[h, idx + head_dim / 2]`` (times the RoPE's
    attention scaling, if any); ``theta`` FP32 ``[kv_heads, k]``: the pairs' angles per position
    (``inv_freq[idx]``, any scaling applied). ``k`` is a power of 2, at least 8 (the correction's
    MMA takes ``2k >= 16`` rows) and at most ``head_dim / 2``. All contiguous on the cache's
    device; build with :meth:`select`, :meth:`top_pairs` or :meth:`all_pairs`."""

    idx: torch.Tensor
    b: torch.Tensor
    theta: torch.Tensor

    @property
    def pairs(self) -> int:
        return self.idx.shape[-1]

    @staticmethod
    def check_pairs(k: int, head_dim: int, kernel_pairs: bool = True) -> None:
        """ValueError unless ``k`` pairs fit a head of ``head_dim``: with ``kernel_pairs`` (the
        attention kernels' limit) a power of 2 in ``[8, head_dim / 2]``, else in ``[1, head_dim / 2]``."""
        if k < 1 or k > head_dim // 2 or kernel_pairs and (k < 8 or k & (k - 1)):
            limit = f"a power of 2 in [8, {head_dim // 2}]" if kernel_pairs else f"in [1, {head_dim // 2}]"
            raise ValueError(f"rot_center pairs must be {limit}, got {k}")

    def check(self, num_kv_heads: int, head_dim: int, kernel_pairs: bool = True) -> None:
        """ValueError unless the tensors have the documented shapes, dtypes and layout and (with
        ``kernel_pairs``, the attention kernels' limit) ``k`` is a power of 2 in ``[8, head_dim /
        2]`` (else any ``k`` in ``[1, head_dim / 2]``: the torch path and the cache write)."""
        self.check_pairs(self.pairs, head_dim, kernel_pairs)
        k = self.pairs
        for name, t, shape, dtype in (("idx", self.idx, (num_kv_heads, k), torch.int32),
                                      ("b", self.b, (num_kv_heads, 2, k), torch.float32),
                                      ("theta", self.theta, (num_kv_heads, k), torch.float32)):
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"rot_center.{name} must be contiguous {dtype} {shape}, got "
                                 f"{t.dtype} {tuple(t.shape)}")

    @classmethod
    def select(cls, b: torch.Tensor, theta: torch.Tensor, idx: torch.Tensor) -> "RotCenter":
        """The pairs ``idx [kv_heads, k]`` of a full center ``b [kv_heads, head_dim]`` with the
        angles ``theta [head_dim / 2]`` (or per head ``[kv_heads, head_dim / 2]``)."""
        half = b.shape[-1] // 2
        idx = idx.to(device=b.device, dtype=torch.long)
        b = b.float()
        sel = torch.stack([b[:, :half].gather(1, idx), b[:, half:].gather(1, idx)], dim=1)
        th = theta.float().to(b.device)
        th = th.expand(b.shape[0], half) if th.dim() == 1 else th
        return cls(idx.to(torch.int32).contiguous(), sel.contiguous(),
                   th.gather(1, idx).contiguous())

    @classmethod
    def top_pairs(cls, b: torch.Tensor, theta: torch.Tensor, k: int) -> "RotCenter":
        """Each head's ``k`` pairs of largest ``|b_pair|`` (the study's ``hybrid_offsets``)."""
        half = b.shape[-1] // 2
        norm = b.float().view(b.shape[0], 2, half).norm(dim=1)
        return cls.select(b, theta, norm.topk(k, dim=-1).indices)

    @classmethod
    def all_pairs(cls, b: torch.Tensor, theta: torch.Tensor) -> "RotCenter":
        """Every pair: ``rot_center = (b, theta)``."""
        half = b.shape[-1] // 2
        idx = torch.arange(half, device=b.device).expand(b.shape[0], half)
        return cls.select(b, theta, idx)


def _launch_defaults_512(layout, decode: bool) -> LaunchShape:
    """Head_dim 512 (Gemma 4's global layers): the output accumulators alone take 128 registers
    per thread in one warp. Decode, NVFP4 K and V (timed on the H200): 16 keys x 2 warps, the
    head dim in 2 parts (one per warp: 64 accumulator registers each, no spill uncapped), K and
    V block scales folded, lazy rescale, and the register cap of :func:`decode_register_cap`
    where the grid is large: 0.92-0.95x our FP8's time at 16 x 4k, 64 x 4k and 64 x 32k, and
    0.95x at 16 x 32k with the doubled splits of :func:`decode_splits` (one warp of 16 keys
    before, 57 registers spilled: 1.11-1.22x). Chosen by the
    sm_90 compile check (``benchmarks/compile_sm90.py --head-dim 512 --group 8``), not timed:
    FP8 / FP8 64 keys x 4 warps (no spill), FP8 / NVFP4 pairs 16 keys x 1 warp (head-dim parts
    compile to more instructions there). Prefill: FP8 / FP8 32 keys x 4 warps x 16 rows (no spill); NVFP4 K /
    FP8 V 16 keys x 2 warps x 8 rows (no spill); an NVFP4 V 16 keys x 1 warp x 8 rows."""
    fp8_k, fp8_v = layout.k_format is KVFormat.FP8, layout.v_format is KVFormat.FP8
    if decode:
        if not fp8_k and not fp8_v:
            return LaunchShape(16, 2, dim_parts=2, fold_k_scales=True, fold_v_scales=True,
                               lazy_rescale=True)
        return LaunchShape(64, 4) if fp8_k and fp8_v else LaunchShape(16, 1)
    if fp8_v:
        return LaunchShape(32, 4, 16) if fp8_k else LaunchShape(16, 2, 8)
    return LaunchShape(16, 1, 8)


def launch_defaults(layout, decode: bool) -> LaunchShape:
    """The launch shape of ``layout`` (decode or prefill), chosen by timing on Hopper.

    Decode: 64 keys per tile, 1 warp, or 2 for FP8 K and V; with an NVFP4 plane 32 keys at
    head_dim 256 (64 exceed the register file; FP8 / FP8 at head_dim 256 keeps 64 keys x 2 warps,
    which compiles for sm_90 without spills where 32 keys x 1 warp spills). Code variants where
    they were faster at every shape timed: NVFP4 K and V fold the K block scales into the K
    planes; an NVFP4 V at head_dim <= 128 folds its block scales into the V planes (H200, 32 q /
    8 KV heads, NVFP4 K and V, two runs: 16 x 32k 221.1 -> 202.2 / 201.4 us, 64 x 4k 124.5 ->
    118.1 / 118.2, 16 x 4k 43.0 -> 42.4 / 42.5, 64 x 32k 806.5 -> 793.2 / 789.9; FP8 K: 1-4%);
    an NVFP4 K with an FP8 V (head_dim <= 128) and FP8 K and V at head_dim 256 hoist the query
    operands. NVFP4 K and V at head_dim <= 128 cap registers at 184 where a split
    holds <= 1024 keys (H200, 32 q / 8 KV heads, one process: 64 x 4k 148.2 -> 124.2 us, 16 x 4k
    43.2 -> 42.8 us at 512 keys per split; uncapped the kernel takes 168 registers and 64 x 32k,
    4096 keys per split, runs 797.0 us against 834.8 capped). An NVFP4 K at head_dim <= 128
    pipelines splits of at least 1024 keys with :data:`PIPELINED_STAGES` stages. Prefill: 64
    keys (32 at head_dim 256); with an FP8 V 2 warps x 32 query rows, else 1 warp x 16 rows.
    Head_dim 512: :func:`_launch_defaults_512`."""
    if layout.head_dim > 256:
        return _launch_defaults_512(layout, decode)
    tile = 32 if layout.head_dim >= 256 else 64
    if not decode:
        return LaunchShape(tile, 2, 32) if layout.v_format is KVFormat.FP8 else LaunchShape(tile, 1, 16)
    fp8_k, fp8_v = layout.k_format is KVFormat.FP8, layout.v_format is KVFormat.FP8
    if fp8_k and fp8_v:
        return LaunchShape(64, 2, hoist_query=layout.head_dim >= 256)
    fold_v = not fp8_v and layout.head_dim <= 128
    long_stages = PIPELINED_STAGES if not fp8_k and layout.head_dim <= 128 else None
    if not fp8_k and not fp8_v:
        return LaunchShape(tile, 1, fold_k_scales=True, fold_v_scales=fold_v,
                           short_split_maxnreg=184 if layout.head_dim <= 128 else None,
                           long_split_stages=long_stages)
    return LaunchShape(tile, 1, hoist_query=not fp8_k and layout.head_dim <= 128,
                       fold_v_scales=fold_v, long_split_stages=long_stages)
