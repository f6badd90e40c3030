"""The JSON writer of policies and results: one line per number vector, exact round trip."""

import json
import random
import struct
from pathlib import Path

import pytest

from vllm_nvfp4 import json_text
from vllm_nvfp4.policy import POLICY_FORMAT, KVPolicy

REPO = Path(__file__).resolve().parents[1]


def test_layout_of_a_small_document():
    doc = {"a": [1, 2.5, -3e-9], "b": {"c": [[1, 2], [3.25]], "d": []}, "e": ["x", True, None],
           "f": {}, "g": 0.1}
    assert json_text.dumps(doc) == (
        '{\n'
        '  "a": [1, 2.5, -3e-09],\n'
        '  "b": {\n'
        '    "c": [\n'
        '      [1, 2],\n'
        '      [3.25]\n'
        '    ],\n'
        '    "d": []\n'
        '  },\n'
        '  "e": [\n'
        '    "x",\n'
        '    true,\n'
        '    null\n'
        '  ],\n'
        '  "f": {},\n'
        '  "g": 0.1\n'
        '}')


def test_bools_are_not_numbers_and_keys_must_be_strings():
    assert json_text.dumps([True, 1]) == "[\n  true,\n  1\n]"
    with pytest.raises(TypeError, match="keys must be strings, got 3"):
        json_text.dumps({3: 1.0})


def _random_floats(rng: random.Random, n: int) -> list[float]:
    """Finite doubles from random bit patterns: every exponent, subnormals, negative values."""
    out = []
    while len(out) < n:
        x = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]
        if x == x and abs(x) != float("inf"):
            out.append(x)
    return out


def test_policy_vectors_one_line_each_and_exact_round_trip(tmp_path):
    rng = random.Random(7)
    heads, head_dim, layers = 2, 128, 3
    center = [[_random_floats(rng, head_dim) for _ in range(heads)] for _ in range(layers)]
    smooth = [[[rng.uniform(0.5, 40.0) for _ in range(head_dim)] for _ in range(heads)]
              for _ in range(layers)]
    p = KVPolicy.from_compact("0:fp8,*:nvfp4", layers)
    for i in range(layers):
        p = p.with_layer(i, k_center=center[i], k_smooth=smooth[i], k_scale=rng.random() + 1e-3,
                         v_global_scale=tuple(rng.random() + 1e-3 for _ in range(heads)))
    path = p.save(tmp_path / "policy.json")
    lines = path.read_text().splitlines()

    vectors = [row for layer in center + smooth for row in layer]
    vector_lines = [line for line in lines if line.strip().startswith("[") and
                    line.strip().rstrip(",").endswith("]")]
    assert len(vector_lines) == len(vectors)
    assert sorted(json.loads(line.strip().rstrip(",")) for line in vector_lines) == sorted(vectors)
    assert len(lines) < 30 * layers  # one number per line would be > 2 * heads * head_dim * layers

    q = KVPolicy.load(path)
    assert q.layers == p.layers  # every float bit-exact
    assert q.save(tmp_path / "again.json").read_bytes() == path.read_bytes()
    assert json.loads(json_text.dumps({"x": vectors})) == {"x": vectors}


def _committed_policy_files() -> list[Path]:
    found = []
    for top in ("docs", "results", "benchmarks"):
        for f in sorted((REPO / top).rglob("*.json")) if (REPO / top).is_dir() else ():
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(data, dict) and data.get("format") == POLICY_FORMAT:
                found.append(f)
    return found


def test_committed_policy_files_are_written_by_the_writer():
    files = _committed_policy_files()
    assert files, "no policy files found under docs/ or results/"
    for f in files:
        text = f.read_text(encoding="utf-8")
        assert text == json_text.dumps(json.loads(text)) + "\n", f"{f}: rewrite it with KVPolicy.save"
        KVPolicy.load(f)
