"""The accuracy evaluation (:mod:`vllm_nvfp4.evaluation.accuracy`, ``scripts/eval_accuracy.py``) end
to end on the tiny model with real vLLM (CPU): two engines (``auto`` and ``nvfp4_all``),
teacher-forced windows, passkey, KV capacity, and one GSM8K question through the real ``lm_eval``
command line for ``auto`` (~2 min on 2 cores)."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest

from vllm_nvfp4.evaluation.accuracy import main

pytestmark = pytest.mark.vllm


def _gsm8k_file(tmp_path: Path) -> Path:
    f = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many apples does he have?",
             "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"} for i in range(8)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


def test_eval_accuracy_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    if shutil.which("lm_eval") is None and not (Path(__import__("sys").executable).parent / "lm_eval").is_file():
        pytest.skip("lm-eval is not installed (pip install lm-eval)")
    import json.decoder as text_src

    text = tmp_path / "text.txt"
    text.write_text(inspect.getsource(text_src) * 3)
    out = tmp_path / "out"
    rc = main([str(tiny_model_dir), "--out", str(out), "--configs", "auto,nvfp4_all",
                         "--text", str(text), "--nll-windows", "2", "--window-tokens", "128",
                         "--passkey-context", "256", "--passkey-trials", "2",
                         "--gsm8k-n", "1", "--gsm8k-n-nvfp4", "0", "--gsm8k-data", str(_gsm8k_file(tmp_path)),
                         "--gsm8k-max-model-len", "1024"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    auto, nv = res["configs"]["auto"], res["configs"]["nvfp4_all"]
    for c in (auto, nv):  # vLLM's capacity agrees with the arithmetic (floor to whole blocks only)
        kv = c["kv_bytes"]
        assert kv["expected"] <= kv["measured"] <= kv["expected"] * (1 + 1 / kv["num_blocks"])
        assert c["passkey"]["trials"] and len(c["passkey"]["trials"]) == 2
    assert nv["fraction_of_fp8"] == pytest.approx(0.5625)
    assert res["noise_floor"]["delta_nll"]["mean"] == pytest.approx(0.0, abs=1e-3)
    assert nv["nll"]["tokens"] == 2 * 127 and 0.0 <= nv["nll"]["top1_agreement"] <= 1.0
    assert nv["nll"]["delta_nll"]["n"] == 2
    g = auto["gsm8k"]
    assert g["n"] == 1 and "VLLM_CPU_KVCACHE_SPACE=1 lm_eval --model vllm" in g["command"]
    assert "--model_args pretrained=" in g["command"] and "gsm8k" not in nv
    assert (out / "results.md").read_text().count("| nvfp4_all |") == 1
    assert (out / "accuracy.png").is_file()
    # a second run reuses the finished engines and lm-eval results
    assert main([str(tiny_model_dir), "--out", str(out), "--configs", "auto,nvfp4_all",
                           "--text", str(text), "--nll-windows", "2", "--window-tokens", "128",
                           "--passkey-context", "256", "--passkey-trials", "2", "--gsm8k-n", "1",
                           "--gsm8k-n-nvfp4", "0", "--gsm8k-data", str(_gsm8k_file(tmp_path)),
                           "--gsm8k-max-model-len", "1024"]) == 0
