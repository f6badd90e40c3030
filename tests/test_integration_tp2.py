"""Tensor parallel 2 on CPU (two worker processes, one core each, gloo): same greedy tokens as
TP=1, and each rank holds its own KV heads' per-head scales from the policy."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import vllm_subprocess_env

pytestmark = pytest.mark.vllm

SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    def scales(worker):
        ctx = worker.model_runner.compilation_config.static_forward_context
        return {n: [l.impl.k_scale.tolist(), l.impl.v_scale.tolist()] for n, l in ctx.items()
                if hasattr(l.impl, "layout")}

    if __name__ == "__main__":
        out = {}
        for tp in (1, 2):
            llm = LLM(model=sys.argv[1], kv_cache_dtype="nvfp4_mixed", dtype="float32",
                      max_model_len=256, enforce_eager=True, tensor_parallel_size=tp,
                      distributed_executor_backend="mp", seed=0)
            gen = llm.generate(["def foo(x):\\n    return", "import os\\nimport sys\\n"],
                               SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
            out[tp] = {"tokens": [list(o.outputs[0].token_ids) for o in gen],
                       "scales": llm.collective_rpc(scales)}
            del llm
        print("RESULT " + json.dumps(out))
""")


def test_tp2_matches_tp1_and_splits_per_head_scales(tmp_path: Path):
    from vllm_nvfp4.policy import KVPolicy
    from vllm_nvfp4.testing.models import build_tiny_llama

    model = build_tiny_llama(tmp_path / "m", dtype="float32")  # 2 KV heads
    policy = KVPolicy.from_compact("0:fp8,1:k=fp8,v=nvfp4,*:nvfp4", 4)
    policy = policy.with_layer(1, k_scale=(0.5, 0.25), v_global_scale=(0.125, 0.0625))
    policy.save(model / "nvfp4_policy.json")
    (tmp_path / "run.py").write_text(SCRIPT)
    # 2 workers on 1 NUMA node: bind one core each; the scale probe is a function sent to workers
    env = vllm_subprocess_env(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    run = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(model)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, (run.stdout + run.stderr)[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["1"]["tokens"] == out["2"]["tokens"]
    layer1 = "model.layers.1.self_attn.attn"
    assert out["1"]["scales"][0][layer1] == [[0.5, 0.25], [0.125, 0.0625]]
    rank0, rank1 = out["2"]["scales"]
    assert rank0[layer1] == [[0.5], [0.125]] and rank1[layer1] == [[0.25], [0.0625]]
    assert rank0["model.layers.2.self_attn.attn"] == [[pytest.approx(1 / 6)]] * 2  # defaults
