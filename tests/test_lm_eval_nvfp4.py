"""lm-eval's CLI with ``--model vllm`` and ``kv_cache_dtype=nvfp4_mixed`` on a local task.

The task (``tests/data/nvfp4_tiny_mc.yaml``: 8 multiple-choice items, 24 log-likelihood requests)
runs to completion through vLLM's prompt log-probs; the model is random, so the accuracy itself
is not checked, only that every document was scored.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import vllm_subprocess_env

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent


def test_lm_eval_runs_a_local_task(tiny_model_dir: Path, tmp_path: Path):
    out_dir = tmp_path / "results"
    model_args = ",".join([f"pretrained={tiny_model_dir}", "kv_cache_dtype=nvfp4_mixed",
                           "enforce_eager=True", "max_model_len=512", "seed=0"])
    cmd = ["lm_eval", "--model", "vllm", "--model_args", model_args, "--tasks", "nvfp4_tiny_mc",
           "--include_path", "tests/data", "--batch_size", "auto", "--output_path", str(out_dir)]
    env = vllm_subprocess_env(HF_DATASETS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert (run.stdout + run.stderr).count("KV policy in force: ") == 1  # our integration served it
    (result_file,) = out_dir.rglob("results_*.json")
    results = json.loads(result_file.read_text())
    task = results["results"]["nvfp4_tiny_mc"]
    assert 0.0 <= task["acc,none"] <= 1.0
    assert results["n-samples"]["nvfp4_tiny_mc"]["effective"] == 8
    assert results["config"]["model_args"]["kv_cache_dtype"] == "nvfp4_mixed"
