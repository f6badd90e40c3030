"""FlashInfer's decode on an NVFP4 paged cache: the kernel vLLM's own ``--kv-cache-dtype nvfp4``
runs on Hopper, driven as vLLM 0.34's FLASHINFER backend drives it.

``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, backend="auto")`` with CUDA-graph
buffers, layout HND, K and V each ``uint8 [pages, kv_heads, page_size, head_dim / 2]`` (two E2M1
per byte) with ``float8_e4m3fn [pages, kv_heads, page_size, head_dim / 16]`` block scales
(``kv_cache_sf``) and FP32 global scales ``k_scale``/``v_scale``; bf16 query and output. On SM90
FlashInfer runs its fa2 tensor-core kernel with software E2M1 dequantization. Also FlashInfer on
an FP8 cache (the same wrapper, ``float8_e4m3fn`` pages), for reference.

Used by :mod:`benchmarks.bench_decode` (``--flashinfer``); records carry ``kernel: flashinfer``.
"""

from __future__ import annotations

from typing import Callable

import torch

WORKSPACE_BYTES = 256 * 1024 * 1024


def _random_nvfp4(pages: int, kv_heads: int, page: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random valid NVFP4 pages: data bytes uniform, E4M3 scales in [2^-6, 2) (no NaN codes)."""
    data = torch.randint(0, 256, (pages, kv_heads, page, head_dim // 2), dtype=torch.uint8, device="cuda")
    sf = torch.randint(0, 256, (pages, kv_heads, page, head_dim // 16), dtype=torch.uint8, device="cuda")
    sf.bitwise_and_(0x3F).bitwise_or_(0x08)
    return data, sf.view(torch.float8_e4m3fn)


def flashinfer_peers(block_table: torch.Tensor, ctx: int, query: torch.Tensor, kv_heads: int,
                     page_size: int, softmax_scale: float, timer: Callable[[Callable[[], object]], float],
                     kv_bytes_per_token_head: dict[str, float]) -> list[dict]:
    """Time FlashInfer's decode (one query token per sequence) on NVFP4 and FP8 pages.

    ``block_table``: int32 ``[batch, blocks per sequence]`` (page ids, shuffled), every sequence
    ``ctx`` tokens long; ``query``: bf16 ``[batch, q_heads, head_dim]``; ``timer`` times a callable
    (CUDA-graph replays, microseconds). Returns records (``kernel``, ``kv_dtype``, ``us``,
    ``kv_bytes``) or one record with ``error`` per format that fails: errors are results here.
    """
    try:
        import flashinfer
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper
    except Exception as e:  # noqa: BLE001
        return [{"kernel": "flashinfer", "error": f"flashinfer not importable: {e!r}"[:500]}]
    batch, nblk = block_table.shape
    q_heads, head_dim = query.shape[1], query.shape[2]
    pages = int(block_table.max()) + 1
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * nblk
    indices = block_table.reshape(-1).contiguous()
    last = torch.full((batch,), ctx - (nblk - 1) * page_size, dtype=torch.int32, device="cuda")
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    recs = []
    for kv_dtype in ("nvfp4", "fp8"):
        try:
            if kv_dtype == "nvfp4":
                (k, ks), (v, vs) = (_random_nvfp4(pages, kv_heads, page_size, head_dim) for _ in range(2))
                extra = {"kv_cache_sf": (ks, vs)}
                plan_kv = torch.uint8
            else:
                shape = (pages, kv_heads, page_size, head_dim)
                k, v = (torch.randn(shape, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
                extra, plan_kv = {}, torch.float8_e4m3fn
            wrapper = BatchDecodeWithPagedKVCacheWrapper(
                workspace, "HND", use_cuda_graph=True, use_tensor_cores=True, backend="auto",
                paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
                paged_kv_last_page_len_buffer=last.clone())
            wrapper.plan(indptr, indices, last, q_heads, kv_heads, head_dim, page_size,
                         pos_encoding_mode="NONE", sm_scale=softmax_scale,
                         q_data_type=torch.bfloat16, kv_data_type=plan_kv, o_data_type=torch.bfloat16)
            out = torch.empty_like(query)

            def run() -> None:
                wrapper.run(query, (k, v), k_scale=0.01, v_scale=0.02, out=out, **extra)
            run()  # JIT-compiles outside the graph capture
            torch.cuda.synchronize()
            if not torch.isfinite(out).all():
                raise RuntimeError("non-finite output")
            recs.append({"kernel": "flashinfer", "kv_dtype": kv_dtype, "us": timer(run),
                         "kv_bytes": int(batch * ctx * kv_heads * kv_bytes_per_token_head[kv_dtype]),
                         "config": f"flashinfer {flashinfer.__version__}, page {page_size}"})
            del k, v, wrapper
        except Exception as e:  # noqa: BLE001
            recs.append({"kernel": "flashinfer", "kv_dtype": kv_dtype, "error": repr(e)[:500]})
        torch.cuda.empty_cache()
    return recs
