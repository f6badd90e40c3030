"""Disaggregated prefill through vLLM's ExampleConnector with ``kv_cache_dtype="nvfp4_mixed"``.

A producer engine stores every prompt's full blocks (shared-storage files, one per layer); a
fresh consumer engine with the same connector loads them instead of computing those prompt
tokens. The consumer's greedy tokens and the log-probs of its generated tokens must equal an
engine that computed everything itself (prefix caching off everywhere, so a loaded block is the
only way a prompt token is skipped). The loaded blocks hold FP8 and NVFP4 planes of a mixed
policy, so a connector that moved anything but whole pages would change the outputs.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

NUM_PROMPTS = 64
NEW_TOKENS = 12
BLOCK = 16
LOGPROB_TOL = 1e-4  # same cache bytes, same kernels: float noise only


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    # even lengths 40..62: never 1 mod 16, where the ExampleConnector stores whole blocks of the
    # prompt but looks up whole blocks of prompt[:-1] (a miss by design)
    return [[rng.randrange(5, 4000) for _ in range(40 + 2 * (i % 12))] for i in range(NUM_PROMPTS)]


def _run(model_dir: Path, store: Path | None) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    transfer = None if store is None else {
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    llm = LLM(model=str(model_dir), kv_cache_dtype="nvfp4_mixed", dtype="float32",
              block_size=BLOCK, max_model_len=512, max_num_seqs=8, enforce_eager=True,
              distributed_executor_backend="uni", seed=0, enable_prefix_caching=False,
              kv_transfer_config=transfer)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                       logprobs=0), use_tqdm=False)
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
           "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                        for o in outs],
           "cached": [o.num_cached_tokens for o in outs]}
    del llm
    gc.collect()
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, mixed_policy_model: Path) -> dict[str, Any]:
    store = tmp_path_factory.mktemp("kvstore")
    out = {"base": _run(mixed_policy_model, None)}
    out["producer"] = _run(mixed_policy_model, store)
    out["stored"] = sorted(p.name for p in store.iterdir())
    out["consumer"] = _run(mixed_policy_model, store)
    return out


@pytest.fixture(scope="module")
def mixed_policy_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny float32 Llama with a policy holding all four K/V format pairs."""
    import json

    from vllm_nvfp4.testing.models import build_tiny_llama

    model = build_tiny_llama(tmp_path_factory.mktemp("pd") / "llama", dtype="float32")
    formats = [("fp8", "fp8"), ("fp8", "nvfp4"), ("nvfp4", "nvfp4"), ("nvfp4", "fp8")]
    policy = {"format": "vllm-nvfp4-policy", "version": 1, "num_layers": 4,
              "layers": [{"index": i, "k": k, "v": v} for i, (k, v) in enumerate(formats)]}
    (model / "nvfp4_policy.json").write_text(json.dumps(policy))
    return model


def _full_blocks(prompt: list[int]) -> int:
    """Tokens the ExampleConnector stores / loads for a prompt: whole blocks of prompt[:-1]."""
    return (len(prompt) - 2) // BLOCK * BLOCK


def test_producer_stores_every_prompt(runs: dict) -> None:
    assert len(runs["stored"]) == NUM_PROMPTS
    assert runs["producer"]["cached"] == [0] * NUM_PROMPTS  # nothing to load yet


def test_consumer_loads_the_full_blocks_of_every_prompt(runs: dict) -> None:
    assert runs["consumer"]["cached"] == [_full_blocks(p) for p in _prompts()]
    assert all(n >= 2 * BLOCK for n in runs["consumer"]["cached"])


@pytest.mark.parametrize("engine", ["producer", "consumer"])
def test_outputs_equal_an_engine_that_computed_everything(runs: dict, engine: str) -> None:
    assert runs[engine]["tokens"] == runs["base"]["tokens"]
    worst = max(abs(a - b) for x, y in zip(runs[engine]["logprobs"], runs["base"]["logprobs"])
                for a, b in zip(x, y))
    assert worst <= LOGPROB_TOL, worst
