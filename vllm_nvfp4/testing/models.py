"""Random model checkpoints for tests, demos and benchmarks: one function per architecture.

* :func:`build_tiny_llama` writes a tiny random-weight Llama / Qwen2 directory (``config.json``,
  ``model.safetensors``, ``generation_config.json``, a trained BPE tokenizer with a chat
  template) that vLLM loads like any downloaded model.
* :func:`build_weightless_model` writes only ``config.json`` and a byte-level tokenizer of a
  preset geometry (:data:`PRESETS`, e.g. Llama-3.1-8B); vLLM runs it with
  ``load_format="dummy"`` (random weights initialised on the device), for speed benchmarks.
* :func:`build_tiny_hybrid` writes a tiny random-weight hybrid or sliding-window model
  (Gemma 3, gpt-oss, Mistral with a window, Qwen3-Next) from the transformers config classes:
  the architecture's own initializer with ``initializer_range = 1/sqrt(hidden)``, the q/k
  projections times ``qk_gain``, the head times 4 with zero special-token rows. Layer
  patterns, chosen so that the default policy puts some full-attention layers in NVFP4 and a
  prompt of a few hundred tokens is longer than the window:

  * ``gemma3``:  12 layers, two sliding (window 32) then one full, four times (vLLM's Gemma 3
    reads ``layer_types``), head_dim 32, 4 / 2 heads;
  * ``gpt_oss``: 12 layers, sliding (window 32) on even layers, full on odd (vLLM's gpt-oss fixes
    this pattern), attention sinks, 4 experts top-2, head_dim 64, 4 / 2 heads;
  * ``mistral``: 6 layers, all sliding (window 48), head_dim 32, 4 / 2 heads;
  * ``qwen3_next``: 8 layers, Gated DeltaNet on 3 of 4 (head dims 128: the CPU kernel's),
    full attention on layers 3 and 7, head_dim 64, 4 / 2 heads, 4 experts (vLLM's CPU build
    runs it in bfloat16 only).

The architectures' ``config.json`` writers are :data:`CONFIGS` (``llama``, ``qwen2``); a new
architecture adds its writer there (and its parameter names to :func:`_random_weights`). Nothing
is fetched: tokenizers come from :mod:`vllm_nvfp4.testing.tokenizers`.

The random weights are scaled so the model is not degenerate: every linear layer is drawn from
N(0, gain^2 / fan_in) (unit-variance activations), embeddings from N(0, 1), and query/key
projections get an extra gain so attention is peaked and depends on the cached K/V (which makes
KV-cache quantization visible in the outputs). The ``lm_head`` rows of the special tokens are zero,
so greedy decoding practically never stops early on ``</s>``.

Results are cached: a directory holds a marker file with its build arguments, and a call with the
same arguments returns at once. Without ``out_dir`` a tiny model goes to ``$VLLM_NVFP4_CACHE``
(default ``~/.cache/vllm-nvfp4``) under a name derived from the arguments.

CLI::

    python -m vllm_nvfp4.testing.models OUT_DIR [--layers 4 --hidden 128 --heads 4 --kv-heads 2
                                                 --head-dim 32 --vocab 4096 --arch llama|qwen2
                                                 --dtype bfloat16|float32|float16 --seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

from vllm_nvfp4.testing.tokenizers import (
    SPECIAL_TOKENS,
    atomic_dir,
    cache_root,
    train_tokenizer,
    write_byte_tokenizer,
)

BUILD_VERSION = 1  # bump when the output of a given argument set changes
MARKER = "tiny_model.json"
WEIGHTLESS_MARKER = "random_model.json"
DTYPES = ("bfloat16", "float16", "float32")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

#: A model geometry: layers, hidden, heads, kv_heads, head_dim, vocab, intermediate (ints).
Shape = dict[str, Any]

#: weight-less presets (:func:`build_weightless_model`): geometry, positions, llama3 RoPE scaling
PRESETS: dict[str, dict[str, Any]] = {
    "llama8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                    intermediate=14336, vocab=128256, max_pos=131072, llama3_rope=True),
    "small": dict(layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128,
                  intermediate=2816, vocab=32000, max_pos=131072, llama3_rope=False),
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32,
                 intermediate=256, vocab=512, max_pos=4096, llama3_rope=False),
}


def _common_config(shape: Shape, dtype: str, max_pos: int, rope: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` fields every decoder architecture here shares."""
    return dict(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max_pos, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype=dtype, dtype=dtype,
        rope_theta=rope["rope_theta"], rope_parameters=rope, initializer_range=0.02, use_cache=True,
    )


def llama_config(shape: Shape, dtype: str, max_pos: int,
                 rope: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` (default RoPE, theta 10000, unless ``rope``)."""
    rope = rope or {"rope_type": "default", "rope_theta": 10000.0}
    return dict(_common_config(shape, dtype, max_pos, rope), architectures=["LlamaForCausalLM"],
                model_type="llama", head_dim=shape["head_dim"], attention_bias=False,
                mlp_bias=False)


def qwen2_config(shape: Shape, dtype: str, max_pos: int,
                 rope: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``config.json`` of a ``Qwen2ForCausalLM`` (q/k/v biases, every layer full attention)."""
    rope = rope or {"rope_type": "default", "rope_theta": 10000.0}
    return dict(_common_config(shape, dtype, max_pos, rope), architectures=["Qwen2ForCausalLM"],
                model_type="qwen2", use_sliding_window=False, sliding_window=None,
                max_window_layers=shape["layers"], layer_types=["full_attention"] * shape["layers"])


#: architecture name -> its ``config.json`` writer
CONFIGS: dict[str, Callable[..., dict[str, Any]]] = {"llama": llama_config, "qwen2": qwen2_config}
ARCHS = tuple(CONFIGS)


def save_tokenizer(model_dir: Path, tok_path: Path, max_pos: int) -> None:
    """Write the trained tokenizer (``tok_path``) into ``model_dir`` with the chat template."""
    from transformers import PreTrainedTokenizerFast

    ftok = PreTrainedTokenizerFast(
        tokenizer_file=str(tok_path), unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", model_max_length=max_pos)
    ftok.chat_template = CHAT_TEMPLATE
    ftok.save_pretrained(str(model_dir))
    # transformers 5 writes "TokenizersBackend"; this name loads in 4.x and 5.x alike
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))


def _random_weights(cfg: dict, arch: str, seed: int, qk_gain: float, dtype: str) -> dict:
    """State dict of a Llama/Qwen2 causal LM (HF parameter names), scaled as the module doc says."""
    import torch

    g = torch.Generator().manual_seed(seed)
    H, V, I = cfg["hidden"], cfg["vocab"], cfg["intermediate"]
    nq, nkv, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    tdtype = getattr(torch, dtype)

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * (gain / math.sqrt(in_f))

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": torch.randn(V, H, generator=g)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(H)
        sd[p + "post_attention_layernorm.weight"] = norm(H)
        sd[p + "self_attn.q_proj.weight"] = lin(nq * hd, H, qk_gain)
        sd[p + "self_attn.k_proj.weight"] = lin(nkv * hd, H, qk_gain)
        sd[p + "self_attn.v_proj.weight"] = lin(nkv * hd, H)
        sd[p + "self_attn.o_proj.weight"] = lin(H, nq * hd)
        if arch == "qwen2":
            sd[p + "self_attn.q_proj.bias"] = 0.1 * torch.randn(nq * hd, generator=g)
            sd[p + "self_attn.k_proj.bias"] = 0.1 * torch.randn(nkv * hd, generator=g)
            sd[p + "self_attn.v_proj.bias"] = 0.1 * torch.randn(nkv * hd, generator=g)
        sd[p + "mlp.gate_proj.weight"] = lin(I, H)
        sd[p + "mlp.up_proj.weight"] = lin(I, H)
        sd[p + "mlp.down_proj.weight"] = lin(H, I)
    sd["model.norm.weight"] = norm(H)
    head = lin(V, H, 4.0)  # logits with std ~4: a clear argmax that still depends on the input
    head[: len(SPECIAL_TOKENS)] = 0.0
    sd["lm_head.weight"] = head
    return {k: v.to(tdtype).contiguous() for k, v in sd.items()}


def build_tiny_llama(
    out_dir: Optional[Union[str, os.PathLike]] = None,
    num_layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 4096,
    seed: int = 0,
    arch: str = "llama",
    dtype: str = "bfloat16",
    intermediate: Optional[int] = None,
    max_pos: int = 4096,
    qk_gain: float = 2.0,
) -> Path:
    """Write (or reuse) a tiny random-weight causal LM directory and return its path.

    Args:
        out_dir: target directory; ``None`` = a per-arguments folder under :func:`cache_root`.
        num_layers, hidden, heads, kv_heads: transformer shape; ``heads % kv_heads == 0``.
        head_dim: per-head size, a multiple of 16 (vLLM's CPU backend wants one of 32, 64, 80, ...).
        vocab: model vocabulary size; the tokenizer is trained to this size.
        seed: weight seed; same arguments give identical weights.
        arch: ``"llama"`` or ``"qwen2"`` (Qwen2 adds q/k/v biases).
        dtype: stored weight dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        intermediate: MLP width (default ``2 * hidden``).
        max_pos: ``max_position_embeddings``.
        qk_gain: extra gain of the q/k projections (peakier attention for larger values).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    for name, v in dict(num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                        head_dim=head_dim, vocab=vocab, max_pos=max_pos).items():
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (NVFP4 blocks), got {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    cfg = dict(layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
               vocab=vocab, intermediate=intermediate or 2 * hidden)
    args = dict(cfg, arch=arch, dtype=dtype, seed=seed, max_pos=max_pos, qk_gain=qk_gain,
                build_version=BUILD_VERSION)

    def build(tmp: Path) -> None:
        from safetensors.torch import save_file

        (tmp / "config.json").write_text(json.dumps(CONFIGS[arch](cfg, dtype, max_pos), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2))
        save_file(_random_weights(cfg, arch, seed, qk_gain, dtype), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        save_tokenizer(tmp, train_tokenizer(vocab), max_pos)

    return _cached_build(out_dir, args, f"tiny-{arch}-{num_layers}l-{hidden}h", build)


def _cached_build(out_dir: Optional[Union[str, os.PathLike]], args: dict[str, Any], name: str,
                  build: Callable[[Path], None]) -> Path:
    """The model directory for the build arguments ``args``: reused when its marker matches,
    else (re)built by ``build(tmp_dir)``; ``out_dir=None``: ``name-<hash of args>`` under
    :func:`cache_root`. Refuses to replace a non-empty directory it did not make."""
    if out_dir is None:
        digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:10]
        out = cache_root() / "models" / f"{name}-{digest}"
    else:
        out = Path(out_dir)
    marker = out / MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == args:
                return out
        except (OSError, ValueError):
            pass
    if out.exists() and any(out.iterdir()) and not marker.exists():
        raise FileExistsError(f"{out} exists, is not empty and was not made by a tiny-model builder")

    def build_marked(tmp: Path) -> None:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps(args, indent=2, sort_keys=True))

    if out.exists():  # stale build with other arguments: rebuild in place
        shutil.rmtree(out)
    return atomic_dir(out, build_marked, MARKER)


def build_weightless_model(out_dir: Union[str, os.PathLike], preset: str = "llama8b",
                           max_pos: Optional[int] = None) -> Path:
    """Write (or reuse, when the marker matches) a weight-less Llama directory of ``preset``.

    ``config.json`` (bf16, RoPE theta 500000; llama3 scaling where the preset says so),
    ``generation_config.json`` and a byte-level tokenizer; no weights (``load_format="dummy"``).
    ``max_pos`` overrides the preset's ``max_position_embeddings``.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    p = dict(PRESETS[preset])
    if max_pos:
        p["max_pos"] = int(max_pos)
    out = Path(out_dir)
    marker = out / WEIGHTLESS_MARKER
    args = dict(p, preset=preset, version=1)
    if marker.exists() and json.loads(marker.read_text()) == args:
        return out
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 500000.0}
    if p["llama3_rope"]:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    cfg = llama_config(p, "bfloat16", p["max_pos"], rope)
    cfg["transformers_version"] = "5.0.0"  # else transformers 5 warns about a Mistral regex
    if p["llama3_rope"]:  # transformers 4.x name of the same thing
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2))
    write_byte_tokenizer(out, p["vocab"], p["max_pos"])
    marker.write_text(json.dumps(args, indent=2, sort_keys=True))
    return out


def weight_bytes(preset: str) -> int:
    """bf16 bytes of a preset's weights (embedding + layers + norm + lm_head)."""
    p = PRESETS[preset]
    h, i, v, hd = p["hidden"], p["intermediate"], p["vocab"], p["head_dim"]
    attn = h * hd * (p["heads"] * 2 + p["kv_heads"] * 2)
    per_layer = attn + 3 * h * i + 2 * h
    return 2 * (2 * v * h + p["layers"] * per_layer + h)


HYBRID_ARCHS = ("gemma3", "gpt_oss", "mistral", "qwen3_next")
HYBRID_BUILD = 2  # bump when the output of a given argument set changes
_ALTERNATING = ["sliding_attention", "full_attention"] * 6
_GEMMA_PATTERN = ["sliding_attention", "sliding_attention", "full_attention"] * 4


_CPU_HEAD_DIMS = {"gemma3": 32, "gpt_oss": 64, "mistral": 32, "qwen3_next": 64}
#: head_dim of each tiny hybrid model on CUDA (the GPU kernels need >= 64): the real models'
GPU_HEAD_DIMS = {"gemma3": 256, "gpt_oss": 64, "mistral": 128, "qwen3_next": 256}


def _hybrid_config(arch: str, vocab: int, max_pos: int, head_dim: Optional[int] = None) -> Any:
    """The transformers config of the tiny ``arch`` model (float32); ``head_dim`` None: the
    small default of each architecture (32 or 64)."""
    if arch not in _CPU_HEAD_DIMS:
        raise ValueError(f"arch must be one of {HYBRID_ARCHS}, got {arch!r}")
    head_dim = head_dim or _CPU_HEAD_DIMS[arch]
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=max_pos, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
                                  initializer_range=1.0 / math.sqrt(128))
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        cfg = Gemma3TextConfig(**common, num_hidden_layers=12, head_dim=head_dim, sliding_window=32,
                               layer_types=list(_GEMMA_PATTERN), query_pre_attn_scalar=head_dim,
                               architectures=["Gemma3ForCausalLM"])
    elif arch == "gpt_oss":
        from transformers import GptOssConfig

        common["intermediate_size"] = 128
        cfg = GptOssConfig(**common, num_hidden_layers=12, head_dim=head_dim, sliding_window=32,
                           layer_types=list(_ALTERNATING), num_local_experts=4,
                           num_experts_per_tok=2, architectures=["GptOssForCausalLM"])
    elif arch == "mistral":
        from transformers import MistralConfig

        cfg = MistralConfig(**common, num_hidden_layers=6, head_dim=head_dim, sliding_window=48,
                            architectures=["MistralForCausalLM"])
    else:
        from transformers import Qwen3NextConfig

        cfg = Qwen3NextConfig(**common, num_hidden_layers=8, head_dim=head_dim,
                              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                              linear_num_key_heads=1, linear_num_value_heads=2,
                              linear_key_head_dim=128, linear_value_head_dim=128,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                              shared_expert_intermediate_size=64, decoder_sparse_step=1,
                              architectures=["Qwen3NextForCausalLM"])
    cfg.dtype = "float32"
    return cfg


def _scale_hybrid_weights(model: Any, qk_gain: float, seed: int) -> None:
    """In place: q/k projections x ``qk_gain``, head x 4 with zero special-token rows, sinks
    and norm weights drawn around their defaults."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        head = model.get_output_embeddings().weight
        head.mul_(4.0)
        head[:4] = 0.0


def build_tiny_hybrid(arch: str, out_dir: Optional[Union[str, os.PathLike]] = None,
                      vocab: int = 4096, seed: int = 0, max_pos: int = 4096,
                      qk_gain: float = 2.0, head_dim: Optional[int] = None) -> Path:
    """Write (or reuse) the tiny random-weight hybrid ``arch`` model (:data:`HYBRID_ARCHS`, see
    the module doc) and return its path; ``out_dir=None``: under :func:`cache_root`.
    ``head_dim``: None for the small default; :data:`GPU_HEAD_DIMS` for the CUDA kernels."""
    import torch

    if arch not in HYBRID_ARCHS:
        raise ValueError(f"arch must be one of {HYBRID_ARCHS}, got {arch!r}")
    args = dict(arch=arch, vocab=vocab, seed=seed, max_pos=max_pos, qk_gain=qk_gain,
                build_version=BUILD_VERSION, hybrid_build=HYBRID_BUILD)
    if head_dim is not None:
        args["head_dim"] = head_dim

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_hybrid_config(arch, vocab, max_pos, head_dim),
                                                 dtype=torch.float32)
        _scale_hybrid_weights(model, qk_gain, seed)
        model.save_pretrained(str(tmp))
        save_tokenizer(tmp, train_tokenizer(vocab), max_pos)

    return _cached_build(out_dir, args, f"tiny-{arch}", build)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vllm_nvfp4.testing.models",
                                 description="Build a tiny random-weight model with a BPE tokenizer.")
    ap.add_argument("out", nargs="?", default=None, help="output directory (default: the cache)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--max-pos", type=int, default=4096)
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.time()
    try:
        path = build_tiny_llama(a.out, num_layers=a.layers, hidden=a.hidden, heads=a.heads,
                                kv_heads=a.kv_heads, head_dim=a.head_dim, vocab=a.vocab,
                                seed=a.seed, arch=a.arch, dtype=a.dtype,
                                intermediate=a.intermediate, max_pos=a.max_pos)
    except (ValueError, FileExistsError) as e:
        ap.error(str(e))
    print(f"tiny {a.arch} model ({time.time() - t0:.1f}s): {path}", flush=True)
    print(path)


if __name__ == "__main__":
    main()
