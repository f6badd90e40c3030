"""A tiny random-weight M-RoPE model that vLLM's CPU build runs: PaddleOCR-VL (an Ernie 4.5
language model with M-RoPE, ``mrope_section`` [4, 6, 6], behind a SigLIP vision tower), from the
transformers config classes, with a local tokenizer and image-processor config.

vLLM 0.32's Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 modules import transformers' torchvision
image processors at import time; PaddleOCR-VL's does not, so it is the M-RoPE architecture the
CPU tests can start without torchvision. Its language model sits where Qwen2/2.5/3-VL's does
(``model.language_model.model``) and takes the same ``[3, tokens]`` positions.

Shape: 4 layers, hidden 128, 4 / 2 heads, head_dim 32, vocabulary 4096 (the trained byte-level
BPE plus the four vision special tokens at the end), float32; vision: 1 layer, hidden 32,
images of at most 112 x 112 pixels (16 image tokens).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional, Union

from vllm_nvfp4.testing.model_cache import BUILD_VERSION, cached_build
from vllm_nvfp4.testing.tokenizers import CHAT_TEMPLATE, train_tokenizer

MROPE_BUILD = 1  # bump when the output of a given argument set changes
#: vision special tokens, the last ids of the vocabulary
VISION_TOKENS = ("<|IMAGE_PLACEHOLDER|>", "<|IMAGE_START|>", "<|IMAGE_END|>", "<|video_pad|>")
MROPE_SECTION = [4, 6, 6]  # sums to head_dim / 2


def _tokenizer(vocab: int, max_pos: int) -> Any:
    """The trained BPE with :data:`VISION_TOKENS` appended (ids ``vocab - 4`` .. ``vocab - 1``)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(train_tokenizer(vocab - len(VISION_TOKENS))), unk_token="<unk>",
        bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=max_pos,
        extra_special_tokens={"image_token": VISION_TOKENS[0]})
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    if len(tok) > vocab:
        raise ValueError(f"the tokenizer has {len(tok)} tokens, more than the vocabulary {vocab}")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _config(vocab: int, max_pos: int, ids: dict[str, int]) -> Any:
    """The transformers ``PaddleOCRVLConfig`` of the tiny model (float32)."""
    from transformers import PaddleOCRVLConfig

    text = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": list(MROPE_SECTION)},
                tie_word_embeddings=False, initializer_range=1.0 / math.sqrt(128))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  patch_size=14, spatial_merge_size=2, image_size=56)
    cfg = PaddleOCRVLConfig(text_config=text, vision_config=vision,
                            image_token_id=ids[VISION_TOKENS[0]],
                            vision_start_token_id=ids[VISION_TOKENS[1]],
                            vision_end_token_id=ids[VISION_TOKENS[2]],
                            video_token_id=ids[VISION_TOKENS[3]], tie_word_embeddings=False,
                            architectures=["PaddleOCRVLForConditionalGeneration"])
    cfg.dtype = "float32"
    return cfg


def _image_processor_config() -> dict[str, Any]:
    """``preprocessor_config.json``: images resized to 56..112 pixels a side (patch 14, merge 2)."""
    return dict(image_processor_type="PaddleOCRVLImageProcessor",
                processor_class="PaddleOCRVLProcessor",
                size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=14,
                merge_size=2, temporal_patch_size=1, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                do_convert_rgb=True)


def build_tiny_paddleocr_vl(out_dir: Optional[Union[str, os.PathLike]] = None, vocab: int = 4096,
                            seed: int = 0, max_pos: int = 4096, qk_gain: float = 2.0) -> Path:
    """Write (or reuse) the tiny PaddleOCR-VL (module doc; q/k projections times ``qk_gain``)
    and return its path; ``out_dir=None``: in the model cache (:mod:`.model_cache`)."""
    import torch

    args = dict(arch="paddleocr_vl", vocab=vocab, seed=seed, max_pos=max_pos, qk_gain=qk_gain,
                build_version=BUILD_VERSION, mrope_build=MROPE_BUILD)

    def build(tmp: Path) -> None:
        from transformers import PaddleOCRVLForConditionalGeneration

        tok = _tokenizer(vocab, max_pos)
        ids = dict(zip(VISION_TOKENS, tok.convert_tokens_to_ids(list(VISION_TOKENS))))
        torch.manual_seed(seed)
        model = PaddleOCRVLForConditionalGeneration(_config(vocab, max_pos, ids)).float()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(qk_gain)
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        tc = json.loads((tmp / "tokenizer_config.json").read_text())
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # loads in transformers 4.x and 5.x
        (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
        (tmp / "preprocessor_config.json").write_text(json.dumps(_image_processor_config(), indent=2))

    return cached_build(out_dir, args, "tiny-paddleocr-vl", build)
