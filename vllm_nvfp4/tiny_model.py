"""Tiny random-weight Llama / Qwen2 checkpoints with a real BPE tokenizer, for tests and demos.

:func:`build_tiny_llama` writes a Hugging Face model directory (``config.json``,
``model.safetensors``, ``generation_config.json``, tokenizer files with a chat template) that vLLM
loads like any downloaded model. Nothing is fetched: the byte-level BPE tokenizer is trained with
``tokenizers`` on the local Python standard library sources.

The weights are random but scaled so the model is not degenerate: every linear layer is drawn
from N(0, gain^2 / fan_in) (unit-variance activations), embeddings from N(0, 1), and query/key
projections get an extra gain so attention is peaked and depends on the cached K/V (which makes
KV-cache quantization visible in the outputs). The ``lm_head`` rows of the special tokens are zero,
so greedy decoding practically never stops early on ``</s>``.

Results are cached: the directory holds ``tiny_model.json`` with the build arguments, and a call
with the same arguments returns at once. Without ``out_dir`` the model goes to
``$VLLM_NVFP4_CACHE`` (default ``~/.cache/vllm-nvfp4``) under a name derived from the arguments.
Trained tokenizers are cached there too (by vocab size), so new shapes build in about a second.

CLI::

    python -m vllm_nvfp4.tiny_model OUT_DIR [--layers 4 --hidden 128 --heads 4 --kv-heads 2
                                             --head-dim 32 --vocab 4096 --arch llama|qwen2
                                             --dtype bfloat16|float32|float16 --seed 0]
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Optional, Union

BUILD_VERSION = 1  # bump when the output of a given argument set changes
MARKER = "tiny_model.json"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
ARCHS = ("llama", "qwen2")
DTYPES = ("bfloat16", "float16", "float32")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def cache_root() -> Path:
    """Directory for cached tiny models and tokenizers (``$VLLM_NVFP4_CACHE`` or ~/.cache/vllm-nvfp4)."""
    env = os.environ.get("VLLM_NVFP4_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "vllm-nvfp4"


def _corpus_files(text_mb: float) -> list[str]:
    """Sorted stdlib ``*.py`` files (site-packages excluded) adding up to about ``text_mb`` MB."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files, size = [], 0
    for f in sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)):
        if "site-packages" in f or "dist-packages" in f:
            continue
        files.append(f)
        size += os.path.getsize(f)
        if size > text_mb * 1e6:
            break
    if not files:
        raise RuntimeError(f"no Python sources found under {stdlib} to train the tokenizer on")
    return files


def _atomic_dir(final: Path, build) -> Path:
    """Run ``build(tmp_dir)`` and move the result to ``final``; safe against concurrent builders."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, final)
        except OSError:  # someone else finished first (final exists and is not empty)
            if not (final / MARKER).exists() and not (final / "tokenizer.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def train_tokenizer(vocab: int = 4096, text_mb: float = 2.0) -> Path:
    """Train (or reuse from the cache) a byte-level BPE tokenizer; returns the ``tokenizer.json`` path.

    ``vocab`` is the target vocabulary size (special tokens included); the trained vocabulary can
    be a little smaller when the corpus runs out of merges.
    """
    if vocab < 512:
        raise ValueError(f"vocab must be >= 512 (byte alphabet + merges), got {vocab}")
    key = f"bpe-v{BUILD_VERSION}-{vocab}-{text_mb:g}mb"
    final = cache_root() / "tokenizers" / key
    path = final / "tokenizer.json"
    if path.exists():
        return path

    def build(tmp: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train(_corpus_files(text_mb), trainer)
        tok.save(str(tmp / "tokenizer.json"))

    _atomic_dir(final, build)
    return path


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


def _hf_config(cfg: dict, arch: str, dtype: str, max_pos: int) -> dict:
    """The ``config.json`` content for the chosen architecture."""
    common = dict(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"], max_position_embeddings=max_pos,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype=dtype, dtype=dtype,
        rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.02, use_cache=True,
    )
    if arch == "llama":
        return dict(common, architectures=["LlamaForCausalLM"], model_type="llama",
                    head_dim=cfg["head_dim"], attention_bias=False, mlp_bias=False)
    return dict(common, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                use_sliding_window=False, sliding_window=None, max_window_layers=cfg["layers"],
                layer_types=["full_attention"] * cfg["layers"])


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

    if out_dir is None:
        digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:10]
        out = cache_root() / "models" / f"tiny-{arch}-{num_layers}l-{hidden}h-{digest}"
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
        raise FileExistsError(f"{out} exists, is not empty and was not made by build_tiny_llama")

    tok_path = train_tokenizer(vocab)

    def build(tmp: Path) -> None:
        from safetensors.torch import save_file

        (tmp / "config.json").write_text(json.dumps(_hf_config(cfg, arch, dtype, max_pos), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2))
        save_file(_random_weights(cfg, arch, seed, qk_gain, dtype), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        save_tokenizer(tmp, tok_path, max_pos)
        (tmp / MARKER).write_text(json.dumps(args, indent=2, sort_keys=True))

    if out.exists():  # stale build with other arguments: rebuild in place
        shutil.rmtree(out)
    return _atomic_dir(out, build)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vllm_nvfp4.tiny_model",
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
