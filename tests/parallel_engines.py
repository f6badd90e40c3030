"""Two engines on CPU, one with a single worker and one split over two worker processes (one core
each, gloo), in a child process; the parallel tests compare what they generate and what a probe
reads from each worker's attention layers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from conftest import vllm_subprocess_env

_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    def probe(worker):
        ctx = worker.model_runner.compilation_config.static_forward_context
        return {n: PROBE for n, l in ctx.items()
                if getattr(getattr(l, "impl", None), "layout", None) is not None}

    if __name__ == "__main__":
        out = {}
        for size in (1, 2):
            llm = LLM(model=sys.argv[1], kv_cache_dtype="nvfp4_mixed", dtype="float32",
                      max_model_len=256, enforce_eager=EAGER, PARALLEL=size,
                      distributed_executor_backend="mp", seed=0)
            gen = llm.generate(["def foo(x):\\n    return", "import os\\nimport sys\\n"],
                               SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
            out[size] = {"tokens": [list(o.outputs[0].token_ids) for o in gen],
                         "probe": llm.collective_rpc(probe)}
            del llm
        print("RESULT " + json.dumps(out))
""")


def run_size_1_and_2(model: Path, work: Path, parallel: str, probe: str, enforce_eager: bool,
                     timeout: int) -> dict[str, Any]:
    """Greedy tokens of two prompts and, per worker, ``{layer name: probe}`` of every attention
    layer (``probe``: a Python expression of the layer ``l``), for ``parallel`` (an ``LLM``
    argument, e.g. ``tensor_parallel_size``) 1 and 2: ``{"1": {"tokens", "probe"}, "2": ...}``."""
    script = work / "run.py"
    script.write_text(_SCRIPT.replace("PROBE", probe).replace("EAGER", str(enforce_eager))
                      .replace("PARALLEL", parallel))
    # 2 workers on 1 NUMA node: bind one core each; the probe is a function sent to the workers
    env = vllm_subprocess_env(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    # output to a file, not a pipe: after a crash vLLM's shared-memory resource tracker keeps a
    # pipe open long after the script exits
    log = work / "run.log"
    with log.open("w") as f:
        run = subprocess.run([sys.executable, str(script), str(model)], cwd=work, stdout=f,
                             stderr=subprocess.STDOUT, timeout=timeout, env=env)
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, text[-4000:]
    return json.loads(lines[0][len("RESULT "):])
