"""The tiny and weight-less model builders: caching, determinism, validation, loading, tokenizers."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from vllm_nvfp4.testing.models import build_tiny_llama, main
from vllm_nvfp4.testing.weightless import PRESETS, build_weightless_model


def test_cached_rebuild_is_instant_and_identical(tmp_path):
    out = build_tiny_llama(tmp_path / "m", num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32)
    before = (out / "model.safetensors").read_bytes()
    t = time.perf_counter()
    again = build_tiny_llama(tmp_path / "m", num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32)
    assert again == out and time.perf_counter() - t < 0.5
    assert (out / "model.safetensors").read_bytes() == before
    other = build_tiny_llama(tmp_path / "m2", num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32)
    assert (other / "model.safetensors").read_bytes() == before, "same arguments, same weights"


def test_changed_arguments_rebuild_and_seed_changes_weights(tmp_path):
    a = load_file(build_tiny_llama(tmp_path / "m", num_layers=2, hidden=64, heads=2, kv_heads=1,
                                   head_dim=32, seed=0) / "model.safetensors")
    b = load_file(build_tiny_llama(tmp_path / "m", num_layers=2, hidden=64, heads=2, kv_heads=1,
                                   head_dim=32, seed=3) / "model.safetensors")
    assert json.loads((tmp_path / "m" / "tiny_model.json").read_text())["seed"] == 3
    w = "model.layers.1.self_attn.k_proj.weight"
    assert a[w].shape == b[w].shape == (32, 64)
    assert not torch.equal(a[w], b[w])


@pytest.mark.parametrize("kwargs, msg", [
    (dict(head_dim=40), "multiple of 16"),
    (dict(heads=4, kv_heads=3), "multiple of kv_heads"),
    (dict(arch="gpt2"), "arch must be"),
    (dict(dtype="int8"), "dtype must be"),
    (dict(num_layers=0), "positive int"),
])
def test_bad_arguments_are_rejected(tmp_path, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        build_tiny_llama(tmp_path / "m", **kwargs)


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_llama(tmp_path / "m")
    assert (tmp_path / "m" / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_loads_it_and_generates_varied_tokens(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_llama(tmp_path / arch, arch=arch, num_layers=2, hidden=64, heads=4, kv_heads=2,
                            head_dim=16, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_key_value_heads) == (arch, 2, 2)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)
    assert (model.model.layers[0].self_attn.q_proj.bias is not None) == (arch == "qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("for i in range(10):\n    print(i)", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
    assert len(set(gen.tolist())) >= 6, f"degenerate greedy output {gen.tolist()}"


def test_tokenizer_round_trips_source_and_has_a_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny_llama(tmp_path / "m", num_layers=1))
    text = 'def f(x: int) -> str:\n    return f"{x:>4} \\u00e9t\u00e9 \u2713"\n'
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) < len(text.encode()), "BPE merges should compress source code"
    assert tok.decode(ids) == text
    assert max(ids) < 4096 and tok.eos_token == "</s>" and tok.bos_token == "<s>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_cli_prints_the_path(tmp_path, capsys):
    main([str(tmp_path / "c"), "--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "2"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "c")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["num_hidden_layers"] == 1
    with pytest.raises(SystemExit):
        main([str(tmp_path / "d"), "--head-dim", "24"])


def test_weightless_preset_has_its_geometry_and_a_byte_tokenizer(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    out = build_weightless_model(tmp_path / "w", "small", max_pos=8192)
    cfg = AutoConfig.from_pretrained(out)
    p = PRESETS["small"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size, cfg.max_position_embeddings) == (p["layers"], p["hidden"],
                                                              p["kv_heads"], p["head_dim"],
                                                              p["vocab"], 8192)
    assert sorted(f.name for f in out.iterdir()) == [
        "config.json", "generation_config.json", "random_model.json", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"]  # no weights: load_format="dummy"
    tok = AutoTokenizer.from_pretrained(out)
    text = "x = [i ** 2 for i in range(7)]  # \u00e9"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text  # one token per byte
    assert tok.convert_ids_to_tokens(p["vocab"] - 1).startswith("tok")
    stamp = (out / "config.json").stat().st_mtime_ns
    assert build_weightless_model(out, "small", max_pos=8192) == out
    assert (out / "config.json").stat().st_mtime_ns == stamp, "same arguments: reused"
    with pytest.raises(ValueError, match="preset must be one of"):
        build_weightless_model(tmp_path / "x", "huge")
