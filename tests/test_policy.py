"""Policy parsing, validation, round trips and serve-time resolution."""

import json
import logging
from dataclasses import replace

import pytest

from vllm_nvfp4.policy import (
    POLICY_ENV,
    POLICY_FILENAME,
    KVPolicy,
    LayerPolicy,
    PolicyError,
    default_policy,
    resolve_policy,
)


def _formats(p: KVPolicy) -> list[tuple[str, str]]:
    return [(lp.k, lp.v) for lp in p.layers]


def test_compact_ranges_negative_indices_and_kv_split():
    p = KVPolicy.from_compact("0-1:fp8,2-4:nvfp4,5:k=fp8,v=nvfp4,-2--1:fp8", 8)
    assert _formats(p) == [("fp8", "fp8")] * 2 + [("nvfp4", "nvfp4")] * 3 + [
        ("fp8", "nvfp4"), ("fp8", "fp8"), ("fp8", "fp8")]
    assert p.to_compact() == "0-1:fp8,2-4:nvfp4,5:k=fp8,v=nvfp4,6-7:fp8"
    assert _formats(KVPolicy.from_compact(p.to_compact(), 8)) == _formats(p)


def test_compact_wildcard_and_v_before_k():
    p = KVPolicy.from_compact("3:v=fp8,k=nvfp4,*:fp8", 5)
    assert _formats(p)[3] == ("nvfp4", "fp8")
    assert p.to_compact() == "0-2:fp8,3:k=nvfp4,v=fp8,4:fp8"


@pytest.mark.parametrize(
    "text,match",
    [
        ("0-3:fp4", "unknown KV format 'fp4'"),
        ("0-3:fp8,3:nvfp4", "layer 3 is named twice"),
        ("0-2:fp8", "leaves layers 3"),
        ("0-4:fp8", "out of range for 4 layers"),
        ("-5:fp8,*:nvfp4", "out of range"),
        ("3-1:fp8", "start after end"),
        ("0-3:k=fp8", "needs both k=FMT and v=FMT"),
        ("0-3:fp8,,", "empty item"),
        ("a:fp8", "bad layer range"),
        ("fp8", "cannot parse"),
        ("*:fp8,*:nvfp4", "twice"),
    ],
)
def test_compact_errors_name_the_problem(text, match):
    with pytest.raises(PolicyError, match=match):
        KVPolicy.from_compact(text, 4)


def test_json_round_trip_with_scales_and_provenance(tmp_path):
    p = KVPolicy.from_compact("0:fp8,*:nvfp4", 3)
    p = p.with_layer(0, k_scale=0.02, v_scale=(0.01, 0.03))
    p = p.with_layer(1, k_global_scale=0.001, v_global_scale=0.002)
    p = KVPolicy(layers=p.layers, provenance={"tool": "test", "kl": [0.1, 0.2]})
    path = p.save(tmp_path / "policy.json")
    q = KVPolicy.load(path)
    assert q.layers == p.layers and dict(q.provenance) == dict(p.provenance)
    assert q.layers[0].quant_scale("v") == (0.01, 0.03)
    assert q.layers[1].quant_scale("k") == 0.001
    assert q.layers[2].quant_scale("k") is None
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        p.save(path)
    p.save(path, overwrite=True)


def test_k_smooth_round_trips_and_is_checked(tmp_path):
    rows = [[1.0, 2.0, 4.0, 1.5], [1.0, 1.0, 3.0, 1.0]]
    p = KVPolicy.from_compact("*:nvfp4", 2).with_layer(1, k_smooth=rows)
    q = KVPolicy.load(p.save(tmp_path / "policy.json"))
    assert q.layers == p.layers and q.layers[1].k_smooth == tuple(map(tuple, rows))
    assert q.to_dict()["layers"][1]["k_smooth"] == rows and "k_smooth" not in q.to_dict()["layers"][0]
    assert "K smoothed" in q.describe().splitlines()[2]
    q.check_model(2, num_kv_heads=2)
    with pytest.raises(PolicyError, match="layer 1 k_smooth has 2 per-head values"):
        q.check_model(2, num_kv_heads=4)
    with pytest.raises(PolicyError, match="layer 1 k_smooth has 4 values per head, the model's head_dim is 64"):
        q.check_model(2, num_kv_heads=2, head_dim=64)
    q.check_model(2, num_kv_heads=2, head_dim=4)
    for bad, match in (([[1.0, 0.0]], "finite numbers > 0"), ([[1.0, 2.0], [1.0]], "differ in length"),
                       ([1.0, 2.0], "one per KV head"), ([], "one per KV head"),
                       ([[1.0, float("inf")]], "finite numbers > 0")):
        with pytest.raises(PolicyError, match=match):
            LayerPolicy("nvfp4", "nvfp4", k_smooth=bad)


def test_k_center_round_trips_and_is_checked(tmp_path):
    """K centering offsets: any finite number (negative too), per KV head x channel; checked
    against the model like k_smooth; described in the start-up table."""
    rows = [[0.5, -120.0, 3.25, 0.0], [-1.0, 2.0, 0.0, 7.5]]
    p = KVPolicy.from_compact("*:fp8", 2).with_layer(0, k_center=rows)
    q = KVPolicy.load(p.save(tmp_path / "policy.json"))
    assert q.layers == p.layers and q.to_dict()["layers"][0]["k_center"] == rows
    assert "K centered" in q.describe().splitlines()[1]
    with pytest.raises(PolicyError, match="layer 0 k_center has 2 per-head values"):
        q.check_model(2, num_kv_heads=1)
    with pytest.raises(PolicyError, match="layer 0 k_center has 4 values per head, the model's head_dim is 8"):
        q.check_model(2, num_kv_heads=2, head_dim=8)
    for bad, match in (([[1.0, float("nan")]], "finite numbers,"), ([[1.0], [1.0, 2.0]], "differ in length"),
                       ([0.5], "one per KV head")):
        with pytest.raises(PolicyError, match=match):
            LayerPolicy("fp8", "fp8", k_center=bad)


def test_k_perm_round_trips_and_is_checked(tmp_path):
    """K channel permutations: per KV head, each channel index exactly once; round-trips through
    JSON as integers; checked against the model like k_center; described in the start-up table."""
    rows = [[2, 0, 3, 1], [0, 1, 2, 3]]
    p = KVPolicy.from_compact("*:nvfp4", 2).with_layer(1, k_perm=rows)
    q = KVPolicy.load(p.save(tmp_path / "policy.json"))
    assert q.layers == p.layers and q.to_dict()["layers"][1]["k_perm"] == rows
    assert "K permuted" in q.describe().splitlines()[2]
    with pytest.raises(PolicyError, match="layer 1 k_perm has 2 per-head values"):
        q.check_model(2, num_kv_heads=1)
    with pytest.raises(PolicyError, match="layer 1 k_perm has 4 values per head, the model's head_dim is 8"):
        q.check_model(2, num_kv_heads=2, head_dim=8)
    for bad, match in (([[0, 1, 1, 3]], "head 0 is not a permutation of 0..3"),
                       ([[0, 1], [1, 2]], "head 1 is not a permutation of 0..1"),
                       ([[0, 1.0]], "head 0 is not a permutation"), ([[True, False]], "not a permutation"),
                       ([3], "one per KV head")):
        with pytest.raises(PolicyError, match=match):
            LayerPolicy("nvfp4", "nvfp4", k_perm=bad)


def _write(tmp_path, data) -> str:
    path = tmp_path / "p.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _valid() -> dict:
    return KVPolicy.from_compact("*:fp8", 2).to_dict()


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: "{not json", "malformed JSON at line 1"),
        (lambda d: {**d, "version": 7}, "unsupported policy version 7"),
        (lambda d: {**d, "format": "other"}, "not a vllm-nvfp4 policy: it has 'format' 'other'"),
        (lambda d: {**d, "num_layers": 3}, "num_layers is 3 but 2 layers"),
        (lambda d: {**d, "layers": [d["layers"][0], {**d["layers"][1], "k": "int8"}]}, r"layers\[1\].*unknown KV format"),
        (lambda d: {**d, "layers": [{**d["layers"][0], "k_scale": -1.0}, d["layers"][1]]}, "finite and > 0"),
        (lambda d: {**d, "layers": [{**d["layers"][0], "v_scale": float("nan")}, d["layers"][1]]}, "finite and > 0"),
        (lambda d: {**d, "layers": [{**d["layers"][0], "k_scale": "big"}, d["layers"][1]]}, "must be a number"),
        (lambda d: {**d, "layers": [{**d["layers"][0], "colour": 1}, d["layers"][1]]}, "unknown keys"),
        (lambda d: {**d, "layers": [d["layers"][1], d["layers"][0]]}, "out of order"),
        (lambda d: [1, 2], "top level must be a JSON object"),
    ],
)
def test_json_validation_errors(tmp_path, mutate, match):
    with pytest.raises(PolicyError, match=match):
        KVPolicy.load(_write(tmp_path, mutate(_valid())))


def test_unreadable_files_are_named_as_such(tmp_path):
    with pytest.raises(PolicyError, match=f"policy file {tmp_path / 'nope.json'} does not exist$"):
        KVPolicy.load(tmp_path / "nope.json")
    with pytest.raises(PolicyError, match="is a directory; give the JSON file"):
        KVPolicy.load(tmp_path)
    (tmp_path / "bin.json").write_bytes(b"\x00\xff\xfe{")
    with pytest.raises(PolicyError, match="bin.json is not UTF-8 text"):
        KVPolicy.load(tmp_path / "bin.json")
    (tmp_path / "cut.json").write_text(json.dumps(_valid())[:40])
    with pytest.raises(PolicyError, match=r"cut.json: malformed JSON at line 1 column \d+: "):
        KVPolicy.load(tmp_path / "cut.json")


@pytest.mark.parametrize("text, fault", [
    ('{"layers": 3}', "not a vllm-nvfp4 policy: it has no 'format' header; a policy file starts "
                      '{"format": "vllm-nvfp4-policy", "version": 1, ...}'),
    ('{"format": "vllm-nvfp4-policy", "version": 1,\n "layers": [{"k": "fp8\n"}]}',
     "malformed JSON at line 2 column 23: Invalid control character after 'layers\": [{\"k\": \"fp8'"),
    ('{"format": "vllm-nvfp4-policy", "version": 1, "num_layers": 2, "layers": [',
     "malformed JSON at line 1 column 75: Expecting value after 'ers\": 2, \"layers\": ['"),
    ("", "malformed JSON at line 1 column 1: Expecting value (the file is empty)"),
    ("   x", "malformed JSON at line 1 column 4: Expecting value after '   '"),
    ("x", "malformed JSON at line 1 column 1: Expecting value at the start: 'x'"),
])
def test_malformed_policy_file_is_one_line_naming_file_fault_and_format(tmp_path, text, fault):
    """A foreign or broken policy file: one line with the file, the fault (the JSON error's
    position and the characters before it) and where the format is documented."""
    from vllm_nvfp4.policy.json_form import FORMAT_DOC

    path = tmp_path / "policy.json"
    path.write_text(text)
    with pytest.raises(PolicyError) as e:
        KVPolicy.load(path)
    assert str(e.value) == f"{path}: {fault}; {FORMAT_DOC}"
    assert "\n" not in str(e.value)
    assert FORMAT_DOC == ("the policy file format is documented in vllm_nvfp4/policy/json_form.py; "
                          "`vllm-nvfp4 calibrate`, `select` and `tune` write one")
    from vllm_nvfp4.policy import json_form

    assert '{"format": "vllm-nvfp4-policy", "version": 1,' in json_form.__doc__  # it is documented there


def test_check_model_layer_count_and_per_head_lengths():
    p = KVPolicy.from_compact("*:nvfp4", 4).with_layer(2, k_global_scale=(0.1, 0.2, 0.3))
    with pytest.raises(PolicyError, match="describes 4 attention layers, but the model has 6"):
        p.check_model(6)
    with pytest.raises(PolicyError, match="layer 2 k_global_scale has 3 per-head values"):
        p.check_model(4, num_kv_heads=2)
    p.check_model(4, num_kv_heads=3)


def test_bytes_and_fraction():
    p = KVPolicy.from_compact("0:fp8,1:k=fp8,v=nvfp4,*:nvfp4", 4)
    # per head D=128: fp8 128 B, nvfp4 72 B
    assert p.kv_bytes_per_token(num_kv_heads=2, head_dim=128) == 2 * (256 + 200 + 144 + 144)
    assert p.fraction_of_fp8() == pytest.approx((2 + 1.5625 + 1.125 + 1.125) / 8)
    assert "layer   1: K fp8" in p.describe()


def test_describe_says_whether_the_scales_are_calibrated():
    """The table's first line counts the K/V slots without a scale (default 1.0 / 1/6); its rows
    name each slot's format and scale, ``default`` where it has none."""
    p = KVPolicy.from_compact("0:fp8,1:k=fp8,v=nvfp4,2:nvfp4", 3, source="test")
    assert p.scales_summary() == "default K/V scales (not calibrated)"
    p = p.with_layer(0, k_scale=0.02, v_scale=0.03).with_layer(1, k_scale=0.5)
    lines = p.describe("KV policy in force").splitlines()
    assert lines[0] == ("KV policy in force: 0:fp8,1:k=fp8,v=nvfp4,2:nvfp4 (0.781x FP8 bytes; 3 of 6 "
                        "K/V scales default (not calibrated); from test)")
    assert lines[1:] == ["  layer   0: K fp8   scale 0.02  V fp8   scale 0.03",
                         "  layer   1: K fp8   scale 0.5  V nvfp4 scale default",
                         "  layer   2: K nvfp4 scale default  V nvfp4 scale default"]
    p = p.with_layer(1, v_global_scale=0.001).with_layer(2, k_global_scale=0.1, v_global_scale=0.2)
    assert p.scales_summary() == "K/V scales calibrated"


def test_default_rule():
    assert default_policy(6).to_compact() == "0:fp8,1-4:nvfp4,5:fp8"
    assert default_policy(2).to_compact() == "0-1:fp8"


def test_resolution_order(tmp_path, caplog):
    model = tmp_path / "model"
    model.mkdir()
    # 3. default, with a debug line (the engine logs the policy in force once it is decided)
    with caplog.at_level(logging.DEBUG, logger="vllm_nvfp4.policy"):
        p = resolve_policy(4, model, env={})
    assert p.to_compact() == "0:fp8,1-2:nvfp4,3:fp8" and "default rule" in caplog.text
    # 2. a file in the model directory wins over the default
    KVPolicy.from_compact("*:fp8", 4).save(model / POLICY_FILENAME)
    assert resolve_policy(4, model, env={}).to_compact() == "0-3:fp8"
    # 1. the environment wins over the model directory: compact string, then a file path
    assert resolve_policy(4, model, env={POLICY_ENV: "*:nvfp4"}).to_compact() == "0-3:nvfp4"
    other = KVPolicy.from_compact("0:nvfp4,*:fp8", 4).save(tmp_path / "mine.json")
    assert resolve_policy(4, model, env={POLICY_ENV: str(other)}).to_compact() == "0:nvfp4,1-3:fp8"
    assert p.source == "default rule (first/last FP8)"
    assert resolve_policy(4, model, env={POLICY_ENV: str(other)}).source == f"{other} ($VLLM_NVFP4_POLICY)"
    with pytest.raises(PolicyError, match=r"^policy file \S+typo.json \(from \$VLLM_NVFP4_POLICY\) does not exist$"):
        resolve_policy(4, model, env={POLICY_ENV: str(tmp_path / "typo.json")})
    with pytest.raises(PolicyError, match="is a directory; name the policy file"):
        resolve_policy(4, model, env={POLICY_ENV: str(model)})
    with pytest.raises(PolicyError, match="but the model has 5"):
        resolve_policy(5, model, env={})


def test_layer_policy_rejects_unknown_format():
    with pytest.raises(PolicyError, match="unknown KV format"):
        LayerPolicy("fp8", "bf16")


# ---------------------------------------------------------------------- layer types (hybrid models)
def _types(config_cls_name: str, **kw):
    import transformers

    from vllm_nvfp4.policy import layer_types_from_config

    return layer_types_from_config(getattr(transformers, config_cls_name)(**kw))


def test_layer_types_from_the_transformers_configs():
    from vllm_nvfp4.policy import FULL_ATTENTION, NO_KV, LayerType

    gemma = _types("Gemma3TextConfig", num_hidden_layers=7, sliding_window=512)  # 5 local : 1 global
    assert gemma == (LayerType("sliding", 512),) * 5 + (FULL_ATTENTION, LayerType("sliding", 512))
    oss = _types("GptOssConfig", num_hidden_layers=4, sliding_window=128)
    assert oss == (LayerType("sliding", 128, True), LayerType("full", None, True)) * 2
    qnext = _types("Qwen3NextConfig", num_hidden_layers=8)
    assert qnext == (NO_KV, NO_KV, NO_KV, FULL_ATTENTION) * 2
    assert _types("MistralConfig", num_hidden_layers=3, sliding_window=4096) == (LayerType("sliding", 4096),) * 3
    assert _types("MistralConfig", num_hidden_layers=3, sliding_window=None) == (FULL_ATTENTION,) * 3
    assert _types("Qwen2Config", num_hidden_layers=3, sliding_window=4096, use_sliding_window=False) == (FULL_ATTENTION,) * 3
    assert _types("LlamaConfig", num_hidden_layers=2) == (FULL_ATTENTION,) * 2


def test_unknown_layer_type_and_bad_layer_types_are_refused():
    from types import SimpleNamespace

    from vllm_nvfp4.policy import LayerType, layer_types_from_config

    with pytest.raises(PolicyError, match="layer 1 of the model has type 'moe_mystery'"):
        layer_types_from_config(SimpleNamespace(num_hidden_layers=2, layer_types=["full_attention", "moe_mystery"]))
    with pytest.raises(PolicyError, match="sets no sliding_window"):
        layer_types_from_config(SimpleNamespace(num_hidden_layers=1, layer_types=["sliding_attention"]))
    with pytest.raises(PolicyError, match="needs a window"):
        LayerType("sliding")
    with pytest.raises(PolicyError, match="unknown layer type"):
        LayerType("local")
    with pytest.raises(PolicyError, match="without KV cache cannot have attention sinks"):
        LayerType("none", sinks=True)


def _gemma_like():
    from vllm_nvfp4.policy import FULL_ATTENTION, LayerType

    swa = LayerType("sliding", 64)
    return (swa, swa, FULL_ATTENTION) * 4  # full layers 2, 5, 8, 11


def _qwen_next_like():
    from vllm_nvfp4.policy import FULL_ATTENTION, NO_KV

    return (NO_KV, NO_KV, NO_KV, FULL_ATTENTION) * 3  # full layers 3, 7, 11


def test_compact_by_type_index_beats_type_beats_wildcard():
    t = _gemma_like()
    p = KVPolicy.from_compact("swa:fp8,full:nvfp4,-1:fp8,0:nvfp4", 12, layer_types=t)
    assert [(lp.k, lp.v) for lp in p.layers] == [
        ("nvfp4", "nvfp4"), ("fp8", "fp8"), ("nvfp4", "nvfp4"), ("fp8", "fp8"), ("fp8", "fp8"),
        ("nvfp4", "nvfp4"), ("fp8", "fp8"), ("fp8", "fp8"), ("nvfp4", "nvfp4"), ("fp8", "fp8"),
        ("fp8", "fp8"), ("fp8", "fp8")]
    assert p.layer_types == t
    q = KVPolicy.from_compact("sliding:k=fp8,v=nvfp4,*:nvfp4", 12, layer_types=t)
    assert (q.layers[0].k, q.layers[0].v, q.layers[2].k) == ("fp8", "nvfp4", "nvfp4")
    assert KVPolicy.from_compact(q.to_compact(), 12, layer_types=t).layers == q.layers


def test_compact_type_errors_say_what_to_fix():
    t = _gemma_like()
    with pytest.raises(PolicyError, match="names 'swa' layers, but the model has none"):
        KVPolicy.from_compact("swa:fp8,*:nvfp4", 4)
    with pytest.raises(PolicyError, match="layer type 'sliding' is named twice"):
        KVPolicy.from_compact("swa:fp8,sliding:nvfp4,*:fp8", 12, layer_types=t)
    with pytest.raises(PolicyError, match=r"leaves layers 2, 5, 8, 11 of 12 without a format"):
        KVPolicy.from_compact("swa:fp8", 12, layer_types=t)


def test_layers_without_kv_take_no_format():
    from vllm_nvfp4.policy import NO_KV

    t = _qwen_next_like()
    p = KVPolicy.from_compact("0-3:fp8,*:nvfp4", 12, layer_types=t)  # a range skips them
    assert [i for i, lp in p.kv_layers()] == [3, 7, 11]
    assert [(p.layers[i].k, p.layers[i].layer_type) for i in (0, 3, 7)] == [
        (None, NO_KV), ("fp8", t[3]), ("nvfp4", t[7])]
    assert p.to_compact() == "3:fp8,7-11:nvfp4"
    assert KVPolicy.from_compact(p.to_compact(), 12, layer_types=t).layers == p.layers
    with pytest.raises(PolicyError, match="'0' in '0:fp8,\\*:nvfp4' names only layers without KV cache"):
        KVPolicy.from_compact("0:fp8,*:nvfp4", 12, layer_types=t)
    with pytest.raises(PolicyError, match="takes no k"):
        LayerPolicy("fp8", "fp8", layer_type=NO_KV)
    assert p.fraction_of_fp8() == pytest.approx((2 + 2 * 1.125) / 6)
    assert p.kv_bytes_per_token(2, 64) == 2 * (2 * 64 + 2 * 2 * 36)  # layers 3, 7, 11 only


def test_json_records_each_layers_type_and_reads_untyped_policies_as_full():
    t = _gemma_like()
    from vllm_nvfp4.policy import LayerType

    oss = tuple(LayerType(x.kind, x.window, True) for x in t)
    p = KVPolicy.from_compact("swa:fp8,full:nvfp4", 12, layer_types=oss)
    d = p.to_dict()
    assert d["layers"][0] == {"index": 0, "type": "sliding", "window": 64, "sinks": True, "k": "fp8", "v": "fp8"}
    assert d["layers"][2] == {"index": 2, "type": "full", "sinks": True, "k": "nvfp4", "v": "nvfp4"}
    assert KVPolicy.from_dict(json.loads(json.dumps(d))) == replace(p, source="<dict>")
    q = KVPolicy.from_compact("3:fp8,*:nvfp4", 12, layer_types=_qwen_next_like())
    assert q.to_dict()["layers"][0] == {"index": 0, "type": "none"}
    assert KVPolicy.from_dict(q.to_dict()).layer_types == _qwen_next_like()
    legacy = KVPolicy.from_compact("*:fp8", 2).to_dict()
    for entry in legacy["layers"]:
        del entry["type"]
    assert KVPolicy.from_dict(legacy).layer_types == KVPolicy.from_compact("*:fp8", 2).layer_types
    bad = dict(d, layers=[dict(d["layers"][0], sinks="yes")] + d["layers"][1:])
    with pytest.raises(PolicyError, match=r"layers\[0\]: 'sinks' must be true or false"):
        KVPolicy.from_dict(bad)
    bad = dict(d, layers=[{"index": 0, "type": "none", "k": "fp8", "v": "fp8"}] + d["layers"][1:])
    with pytest.raises(PolicyError, match=r"layers\[0\]: a layer without KV cache \(type none\) takes no k, v"):
        KVPolicy.from_dict(bad)


def test_a_policy_for_other_layer_types_is_refused():
    t = _gemma_like()
    p = KVPolicy.from_compact("*:fp8", 12)  # written for a dense 12-layer model
    with pytest.raises(PolicyError, match=r"layer 0 is full in the policy but sliding\(64\) in the model"):
        p.check_model(12, layer_types=t)
    from vllm_nvfp4.policy import LayerType

    other_window = tuple(LayerType(x.kind, 128 if x.window else None) for x in t)
    with pytest.raises(PolicyError, match=r"sliding\(64\) in the policy but sliding\(128\)"):
        KVPolicy.from_compact("*:fp8", 12, layer_types=t).check_model(12, layer_types=other_window)


def test_default_rule_by_layer_types():
    from vllm_nvfp4.policy import LayerType

    g = default_policy(12, _gemma_like())  # sliding FP8, full 2 and 11 FP8, full 5 and 8 NVFP4
    assert [i for i, lp in g.kv_layers() if lp.k == "nvfp4"] == [5, 8]
    assert "sliding FP8" in g.source
    q = default_policy(12, _qwen_next_like())  # three full layers: the middle one NVFP4
    assert [(i, lp.k) for i, lp in q.kv_layers()] == [(3, "fp8"), (7, "nvfp4"), (11, "fp8")]
    m = default_policy(5, (LayerType("sliding", 4096),) * 5)  # all sliding: first/last rule on them
    assert m.to_compact() == "0:fp8,1-3:nvfp4,4:fp8"
    two_full = (LayerType("sliding", 8), LayerType("full")) * 2
    assert default_policy(4, two_full).to_compact() == "0-3:fp8"
    with pytest.raises(PolicyError, match="no layer with a KV cache"):
        default_policy(2, (LayerType("none"),) * 2)
    assert default_policy(4).to_compact() == "0:fp8,1-2:nvfp4,3:fp8"  # dense: unchanged


def test_resolve_policy_with_layer_types(tmp_path):
    t = _gemma_like()
    p = resolve_policy(12, tmp_path, env={POLICY_ENV: "swa:fp8,full:nvfp4"}, layer_types=t)
    assert [i for i, lp in p.kv_layers() if lp.k == "nvfp4"] == [2, 5, 8, 11]
    KVPolicy.from_compact("*:fp8", 12).save(tmp_path / POLICY_FILENAME)
    with pytest.raises(PolicyError, match="does not match the model's layer types"):
        resolve_policy(12, tmp_path, env={}, layer_types=t)


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_policy_variable_counts_as_unset_and_the_log_line_says_so(tmp_path, value):
    """``VLLM_NVFP4_POLICY=""`` (e.g. an unset shell variable expanded) falls through to the model
    directory, then the default rule; the policy's source, printed at start-up, says why."""
    model = tmp_path / "model"
    model.mkdir()
    p = resolve_policy(4, model, env={POLICY_ENV: value})
    assert p.to_compact() == "0:fp8,1-2:nvfp4,3:fp8"
    assert p.describe().splitlines()[0] == (
        "KV policy: 0:fp8,1-2:nvfp4,3:fp8 (0.781x FP8 bytes; default K/V scales (not calibrated); "
        "from default rule (first/last FP8); $VLLM_NVFP4_POLICY is set but empty, so it was "
        "ignored)")
    KVPolicy.from_compact("*:fp8", 4).save(model / POLICY_FILENAME)
    p = resolve_policy(4, model, env={POLICY_ENV: value})
    assert p.to_compact() == "0-3:fp8" and p.source.endswith("nvfp4_policy.json; $VLLM_NVFP4_POLICY "
                                                              "is set but empty, so it was ignored")
    assert "set but empty" not in resolve_policy(4, model, env={}).source


def _k_rot_row(**k_rot):
    """Two KV heads, head_dim 8 (pairs 0..3), k_center 0 on the channels of pairs 0 and 2."""
    center = [[0.0, 1.0, 0.0, 2.0, 0.0, 3.0, 0.0, 4.0], [0.0, -1.0, 0.0, 5.0, 0.0, 6.0, 0.0, 7.0]]
    rot = {"pairs": [[0, 2], [2, 0]], "b": [[[1.0, -2.0], [3.0, 4.0]], [[0.5, 0.25], [-1.0, 8.0]]],
           "theta": [[1.0, 0.01], [0.01, 1.0]], **k_rot}
    return center, rot


def test_k_rot_round_trips_and_is_checked(tmp_path):
    """The rotating offset on k RoPE pairs per KV head (docs/design/rotating_centering.md): an
    object of pairs, b (both halves) and theta per head; round-trips through JSON; every
    malformation names k_rot and what is wrong."""
    center, rot = _k_rot_row()
    p = KVPolicy.from_compact("*:nvfp4", 2).with_layer(0, k_center=center, k_rot=rot)
    q = KVPolicy.load(p.save(tmp_path / "policy.json"))
    assert q.layers == p.layers and q.to_dict()["layers"][0]["k_rot"] == rot
    assert q.layers[0].k_rot.num_pairs == 2 and q.layers[0].k_rot.pairs == ((0, 2), (2, 0))
    for change, match in (
            ({"pairs": [[0, 4], [2, 0]]}, r"pairs of KV head 0 must be integers in \[0, 4\)"),
            ({"pairs": [[0, 0], [2, 0]]}, "lists a pair twice"),
            ({"pairs": [[0, 2], [2]]}, "pairs of KV head 1 must list 2 indices"),
            ({"pairs": [[0, 2]]}, "pairs must be a list of 2 entries"),
            ({"pairs": [[0, True], [2, 0]]}, "must be integers"),
            ({"b": [[[1.0, 2.0]], [[1.0, 2.0], [3.0, 4.0]]]}, "b of KV head 0 must be 2 lists"),
            ({"b": [[[1.0, float("inf")], [3.0, 4.0]], [[1.0, 2.0], [3.0, 4.0]]]}, "finite numbers"),
            ({"theta": [[1.0, 0.0], [1.0, 1.0]]}, "theta of KV head 0 must be finite numbers > 0"),
            ({"theta": [[1.0], [1.0, 1.0]]}, "theta of KV head 0 must list 2 angles")):
        with pytest.raises(PolicyError, match="k_rot: .*" + match):
            LayerPolicy("nvfp4", "nvfp4", k_center=center, k_rot={**rot, **change})
    with pytest.raises(PolicyError, match="k_rot: k_rot must be an object with exactly the keys"):
        LayerPolicy("nvfp4", "nvfp4", k_center=center, k_rot={"pairs": rot["pairs"]})
    with pytest.raises(PolicyError, match="k_rot: the rotating offset needs k_center"):
        LayerPolicy("nvfp4", "nvfp4", k_rot=rot)
    moved = [row[:] for row in center]
    moved[1][6] = 0.5  # pair 2's second channel of head 1
    with pytest.raises(PolicyError, match="k_center of KV head 1 must be 0 on the rotated channels.*channel 6"):
        LayerPolicy("nvfp4", "nvfp4", k_center=moved, k_rot=rot)
    with pytest.raises(PolicyError, match="k_rot: the rotating offset is not defined with k_smooth or k_perm"):
        LayerPolicy("nvfp4", "nvfp4", k_center=center, k_rot=rot, k_smooth=[[1.0] * 8] * 2)
    data = p.to_dict()
    data["layers"][0]["k_rot"]["pairs"] = [[0, 9], [2, 0]]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PolicyError, match=r"layers\[0\]: k_rot: pairs of KV head 0"):
        KVPolicy.load(tmp_path / "bad.json")
