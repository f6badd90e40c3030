"""Pipeline parallel 2 on CPU (two worker processes, one core each, gloo): same greedy tokens as
PP=1, and each stage resolves the policy rows of its own layers by their global layer number.

Both engines run compiled (no ``enforce_eager``): vLLM 0.32's CPU runner allocates the tensors a
later pipeline stage receives only in its compile warm-up, so an eager PP=2 engine dies at its
first step (``assert self.intermediate_tensors is not None``), whatever the KV-cache dtype."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import vllm_subprocess_env

pytestmark = pytest.mark.vllm

POLICY = "0:fp8,1:k=fp8,v=nvfp4,2:nvfp4,3:k=nvfp4,v=fp8"  # a different pair on every layer
SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    def formats(worker):
        ctx = worker.model_runner.compilation_config.static_forward_context
        return {n: [l.impl.layout.k_format, l.impl.layout.v_format] for n, l in ctx.items()
                if getattr(getattr(l, "impl", None), "layout", None) is not None}

    if __name__ == "__main__":
        out = {}
        for pp in (1, 2):
            llm = LLM(model=sys.argv[1], kv_cache_dtype="nvfp4_mixed", dtype="float32",
                      max_model_len=256, enforce_eager=False, pipeline_parallel_size=pp,
                      distributed_executor_backend="mp", seed=0)
            gen = llm.generate(["def foo(x):\\n    return", "import os\\nimport sys\\n"],
                               SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
            out[pp] = {"tokens": [list(o.outputs[0].token_ids) for o in gen],
                       "formats": llm.collective_rpc(formats)}
            del llm
        print("RESULT " + json.dumps(out))
""")


def test_pp2_matches_pp1_and_stages_take_global_policy_rows(tmp_path: Path) -> None:
    from vllm_nvfp4.policy import KVPolicy
    from vllm_nvfp4.testing.models import build_tiny_llama

    model = build_tiny_llama(tmp_path / "m", dtype="float32")  # 4 layers
    policy = KVPolicy.from_compact(POLICY, 4)
    policy.save(model / "nvfp4_policy.json")
    (tmp_path / "run.py").write_text(SCRIPT)
    # 2 workers on 1 NUMA node: bind one core each; the format probe is a function sent to workers
    env = vllm_subprocess_env(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    # output to a file, not a pipe: after a crash vLLM's shared-memory resource tracker keeps a
    # pipe open long after the script exits
    log = tmp_path / "run.log"
    with log.open("w") as f:
        run = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(model)], cwd=tmp_path,
                             stdout=f, stderr=subprocess.STDOUT, timeout=1200, env=env)
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, text[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["1"]["tokens"] == out["2"]["tokens"]
    expected = {f"model.layers.{i}.self_attn.attn": [row.k, row.v]
                for i, row in enumerate(policy.layers)}
    assert out["1"]["formats"] == [expected]
    stage0, stage1 = out["2"]["formats"]
    assert sorted(stage0) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1)]
    assert sorted(stage1) == [f"model.layers.{i}.self_attn.attn" for i in (2, 3)]
    assert {**stage0, **stage1} == expected
