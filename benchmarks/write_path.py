"""GPU time of the per-layer work around attention that K centering and the rotating K center
add: the KV cache write of one step and the prefill's dequantization of a context.

Llama-3.1-8B shape (8 KV heads, head_dim 128, block 64, NVFP4 K and V), bf16 keys. Each
configuration is timed as serving runs it: ``LAYERS`` layers' writes captured in one CUDA graph
and replayed (the decode step's case: launches back to back), per layer; and one layer's
dequantization of ``--context`` tokens, eager. Configurations (``--configs``):

* ``plain``: no centering;
* ``center-unfused``: ``stored_keys`` in torch, then the write (what smoothing or a channel
  permutation still run);
* ``center``: the center subtracted inside the write (``LayerOps(k_center=...)``);
* ``rot8-unfused`` / ``rot8``: as the two above, with a rotating center of 8 pairs per KV head.

    python -m benchmarks.write_path [--tokens 16,8192] [--context 32768] [--configs ...] [--out FILE]

Prints one row per configuration (microseconds per layer) and writes them as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

from vllm_nvfp4 import ops
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.key_transform import stored_keys
from vllm_nvfp4.layout import KVPageLayout, allocate_cache

KV_HEADS, HEAD_DIM, BLOCK, LAYERS, PAIRS, ROPE_BASE = 8, 128, 64, 32, 8, 500000.0
CONFIGS = ("plain", "center-unfused", "center", "rot8-unfused", "rot8")


def _layer(cache: torch.Tensor, layout: KVPageLayout, config: str, mu: torch.Tensor,
           rot: RotCenter) -> tuple[Callable[..., None], ops.LayerOps]:
    """``write(key, value, slots, positions)`` of one layer under ``config``, and its ops."""
    scale = torch.ones(KV_HEADS, device=cache.device)
    fused = config in ("center", "rot8")
    layer = ops.LayerOps(cache, layout, scale, scale, rot_center=rot if "rot8" in config else None,
                         **({"k_center": mu} if fused else {}))
    unfused = config.endswith("-unfused")

    def write(key, value, slots, positions):
        layer.write(stored_keys(key, mu) if unfused else key, value, slots, positions)
    return write, layer


def _graph_us(fn: Callable[[], None], reps: int = 20) -> float:
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph."""
    fn()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return sorted(times)[reps // 2]


def run(tokens: list[int], context: int, configs: list[str]) -> list[dict]:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    layout = KVPageLayout(KV_HEADS, HEAD_DIM, BLOCK, "nvfp4", "nvfp4")
    blocks = (context + max(tokens)) // BLOCK + 2
    caches = [allocate_cache(layout, blocks, dev) for _ in range(LAYERS)]
    theta = (ROPE_BASE ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)).float()
    rot = RotCenter.top_pairs(torch.randn(KV_HEADS, HEAD_DIM, generator=gen), theta, PAIRS)
    mu = torch.randn(KV_HEADS, HEAD_DIM, generator=gen)
    for h in range(KV_HEADS):  # zero on the rotated channels, as calibration leaves it
        mu[h, rot.idx[h].long()] = 0.0
        mu[h, rot.idx[h].long() + HEAD_DIM // 2] = 0.0
    rot = RotCenter(rot.idx.to(dev), rot.b.to(dev), rot.theta.to(dev))
    mu = mu.to(dev)
    rows = []
    for config in configs:
        row = {"config": config}
        layers = [_layer(c, layout, config, mu, rot) for c in caches]
        for t in tokens:
            key = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(dev, torch.bfloat16) + 0.3
            value = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(dev, torch.bfloat16)
            slots = torch.arange(t, device=dev)
            positions = torch.arange(context - t, context, dtype=torch.int32, device=dev)

            def step():
                for write, _ in layers:
                    write(key, value, slots, positions)
            row[f"write_{t}_us"] = _graph_us(step) / LAYERS
            print(f"[write_path] {config}: write {t} tokens {row[f'write_{t}_us']:.2f} us/layer",
                  flush=True)
        if config in ("plain", "rot8-unfused", "rot8"):  # centering leaves the reads alone
            layer = layers[0][1]
            fill = torch.randn(context, KV_HEADS, HEAD_DIM, generator=gen).to(dev, torch.bfloat16)
            layer.write(fill, fill, torch.arange(context, device=dev),
                        torch.arange(context, dtype=torch.int32, device=dev))
            k_out = torch.empty(context, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
            v_out = torch.empty_like(k_out)
            table = torch.arange(blocks, dtype=torch.int32, device=dev)[None]
            lens = torch.tensor([context], dtype=torch.int32, device=dev)
            cu = torch.tensor([0, context], dtype=torch.int32, device=dev)
            row[f"dequant_{context}_us"] = _graph_us(lambda: ops.dequantize_kv(
                layer.cache, layout, layer.k_scale, layer.v_scale, table, lens, cu, context,
                k_out, v_out, rot_center=layer.rot_center))
            print(f"[write_path] {config}: dequantize {context} tokens "
                  f"{row[f'dequant_{context}_us']:.1f} us/layer", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tokens", default="16,8192", help="tokens written per step (comma list)")
    ap.add_argument("--context", type=int, default=32768, help="tokens dequantized")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--out", default=None, help="JSON file of the rows")
    a = ap.parse_args()
    configs = a.configs.split(",")
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown --configs {bad}; choose from {', '.join(CONFIGS)}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the timings are of the Triton kernels)")
    rows = run([int(t) for t in a.tokens.split(",")], a.context, configs)
    print(f"{'config':<16}" + "".join(f"{k:>18}" for k in rows[0] if k != "config"))
    for r in rows:
        print(f"{r['config']:<16}" + "".join(f"{v:>18.2f}" for k, v in r.items() if k != "config"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
