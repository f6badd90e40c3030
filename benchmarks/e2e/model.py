"""Write a weight-less model directory for speed benchmarks: ``config.json`` + a tokenizer.

vLLM runs it with ``load_format="dummy"`` (random weights initialised on the GPU, no checkpoint
read), so a Llama-3.1-8B-shaped model costs a few kilobytes on disk instead of 16 GB of bf16
weights. Speed does not depend on the values of the weights; the outputs are meaningless.

The tokenizer is a byte-level BPE with no merges (one token per byte) padded with placeholder
tokens up to the model's vocabulary, so that EVERY id the random model can sample decodes
(``vllm serve`` detokenizes its outputs). Building it needs only the ``tokenizers`` package and
takes about a second; nothing is downloaded.

Presets (``--preset``):

* ``llama8b``: Llama-3.1-8B geometry: 32 layers, hidden 4096, 32 query / 8 KV heads, head_dim 128,
  intermediate 14336, vocab 128256, llama3 RoPE scaling, 131072 positions, bf16.
* ``small``:   8 layers, hidden 1024, 8 / 2 heads, head_dim 128, intermediate 2816, vocab 32000
  (quick GPU runs: same head geometry per KV head, a fraction of the weights).
* ``tiny``:    2 layers, hidden 128, 4 / 2 heads, head_dim 32, vocab 512 (CPU tests).

usage: python -m benchmarks.e2e.model OUT_DIR [--preset llama8b] [--max-pos N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

PRESETS: dict[str, dict[str, Any]] = {
    "llama8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                    intermediate=14336, vocab=128256, max_pos=131072, llama3_rope=True),
    "small": dict(layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128,
                  intermediate=2816, vocab=32000, max_pos=131072, llama3_rope=False),
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32,
                 intermediate=256, vocab=512, max_pos=4096, llama3_rope=False),
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 (bos 1, eos 2)
MARKER = "random_model.json"


def hf_config(p: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of a Llama causal LM with the preset's geometry (bf16)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 500000.0}
    if p["llama3_rope"]:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"],
        max_position_embeddings=p["max_pos"], rms_norm_eps=1e-5, hidden_act="silu",
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", dtype="bfloat16",
        rope_theta=500000.0, rope_parameters=rope, initializer_range=0.02, use_cache=True,
        transformers_version="5.0.0",  # else transformers 5 warns about a Mistral regex
    )
    if p["llama3_rope"]:  # transformers 4.x name of the same thing
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return cfg


def byte_vocab(vocab_size: int) -> dict[str, int]:
    """Special tokens, the 256 byte-level symbols, then placeholders up to ``vocab_size``."""
    from tokenizers import pre_tokenizers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab must be >= {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    i = 0
    while len(vocab) < vocab_size:  # plain ASCII letters/digits decode to themselves
        vocab.setdefault(f"tok{i}", len(vocab))
        i += 1
    return vocab


def write_tokenizer(out: Path, vocab_size: int, max_pos: int) -> None:
    """``tokenizer.json`` (byte-level BPE, no merges) + ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=byte_vocab(vocab_size), merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", model_max_length=max_pos, clean_up_tokenization_spaces=False), indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"), indent=2))


def make_random_model(out_dir: str | Path, preset: str = "llama8b",
                      max_pos: Optional[int] = None) -> Path:
    """Write (or reuse, when the marker matches) the model directory; returns its path."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    p = dict(PRESETS[preset])
    if max_pos:
        p["max_pos"] = int(max_pos)
    out = Path(out_dir)
    marker = out / MARKER
    args = dict(p, preset=preset, version=1)
    if marker.exists() and json.loads(marker.read_text()) == args:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(p), indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2))
    write_tokenizer(out, p["vocab"], p["max_pos"])
    marker.write_text(json.dumps(args, indent=2, sort_keys=True))
    return out


def weight_bytes(preset: str) -> int:
    """bf16 bytes of the preset's weights (embedding + layers + norm + lm_head)."""
    p = PRESETS[preset]
    h, i, v, hd = p["hidden"], p["intermediate"], p["vocab"], p["head_dim"]
    attn = h * hd * (p["heads"] * 2 + p["kv_heads"] * 2)
    per_layer = attn + 3 * h * i + 2 * h
    return 2 * (2 * v * h + p["layers"] * per_layer + h)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output directory (created; reused when it matches)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama8b")
    ap.add_argument("--max-pos", type=int, default=None, help="max_position_embeddings override")
    a = ap.parse_args(argv)
    t0 = time.time()
    path = make_random_model(a.out, a.preset, a.max_pos)
    print(f"model {a.preset} ({weight_bytes(a.preset) / 1e9:.2f} GB of bf16 weights when loaded "
          f"with load_format=dummy) -> {path} ({time.time() - t0:.1f}s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
