"""``LLM(kv_cache_dtype="nvfp4_mixed")`` on CPU with a policy whose every layer has a rotating K
center (``k_rot``: each KV head's top-8 ``|b|`` RoPE pairs of a random ``b``, the model's RoPE
angles, ``k_center`` zero on those pairs), prefix caching and chunked prefill on: the engine runs,
its outputs are finite, a prefix-cache hit gives the cold run's tokens, the positions the
metadata builder derives equal vLLM's ``CommonAttentionMetadata.positions`` at every step, and
``k_rot`` with ``b = 0`` serves what the policy without ``k_rot`` serves (bit for bit on CPU)."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from engine_helpers import engine, greedy

pytestmark = pytest.mark.vllm

FORMATS = [("nvfp4", "nvfp4"), ("fp8", "nvfp4"), ("nvfp4", "fp8"), ("fp8", "fp8")]


def _policy(model_dir: Path, rot: Optional[str]) -> dict:
    """Centered K on every layer, layer 1's first KV head storing its sink key uncentered; ``rot``
    ``"random"`` / ``"zero"``: plus a :class:`KRot` with that ``b`` (None: without). Default
    scales (the same for all three)."""
    from vllm_nvfp4.testing.rot_policy import synthetic_rot_policy

    cfg = json.loads((model_dir / "config.json").read_text())
    formats = [FORMATS[i % len(FORMATS)] for i in range(cfg["num_hidden_layers"])]
    return synthetic_rot_policy(cfg, formats, pairs=8, rot=rot, sink_uncentered_layers=[1],
                                meta={"test": "test_rot_center_engine"}).to_dict()


def _prompts(tokenizer: Any) -> list[list[int]]:
    import inspect
    import json.decoder as src

    ids = tokenizer(inspect.getsource(src))["input_ids"]
    prefix = ids[:150]
    return [prefix + ids[400 + 30 * i:400 + 30 * i + 17 + i] for i in range(3)]


def _run(model_dir: Path, policy: dict, name: str, mp: pytest.MonkeyPatch) -> dict:
    """Prompt log-probs and greedy tokens, cold (prefix cache reset) and again (prefix hits),
    with ``policy`` (through ``$VLLM_NVFP4_POLICY``: the resolved policy is cached by it)."""
    from vllm import SamplingParams

    from vllm_nvfp4.policy import POLICY_ENV

    path = model_dir.parent / f"policy_{name}.json"
    path.write_text(json.dumps(policy))
    mp.setenv(POLICY_ENV, str(path))
    llm = engine(model_dir, enable_prefix_caching=True, enable_chunked_prefill=True,
                 max_num_batched_tokens=64, max_num_seqs=4)
    prompts = _prompts(llm.get_tokenizer())
    inputs = [{"prompt_token_ids": p} for p in prompts]
    out: dict[str, Any] = {}
    llm.reset_prefix_cache()
    lp = llm.generate(inputs, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    out["logprobs"] = torch.tensor([o.prompt_logprobs[i][t].logprob for o, p in zip(lp, prompts)
                                    for i, t in enumerate(p) if i > 0])
    llm.reset_prefix_cache()
    cold = [llm.generate([x], greedy(20), use_tqdm=False)[0] for x in inputs]
    hit = [llm.generate([x], greedy(20), use_tqdm=False)[0] for x in inputs]
    out["cold"] = [list(o.outputs[0].token_ids) for o in cold]
    out["hit"] = [list(o.outputs[0].token_ids) for o in hit]
    out["cached"] = [o.num_cached_tokens for o in hit]
    del llm
    gc.collect()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from vllm_nvfp4.integration import backend
    from vllm_nvfp4.testing.models import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("rot") / "llama", dtype="float32",
                                 head_dim=64)  # the Triton kernels' smallest head_dim
    checked: list[tuple[int, bool]] = []
    build = backend.Nvfp4MixedMetadataBuilder.build

    def recording(self, common_prefix_len, m, fast_build=False):
        meta = build(self, common_prefix_len, m, fast_build)
        if meta.positions is not None and m.positions is not None:
            # served: vLLM's positions; derived (what steps without them use): the same
            n = m.num_actual_tokens
            dev = m.query_start_loc.device
            derived = backend.token_positions(m.query_start_loc, m.seq_lens, m.num_reqs,
                                              torch.arange(n, dtype=torch.int32, device=dev),
                                              torch.empty(n, dtype=torch.int32, device=dev))
            want = m.positions[:n].long()
            checked.append((n, torch.equal(meta.positions[:n].long(), want)
                            and torch.equal(derived.long(), want)))
        return meta

    mp = pytest.MonkeyPatch()
    mp.setattr(backend.Nvfp4MixedMetadataBuilder, "build", recording)
    try:
        out = {name: _run(model_dir, _policy(model_dir, rot), name, mp)
               for name, rot in (("rot", "random"), ("zero", "zero"), ("none", None))}
    finally:
        mp.undo()
    out["positions_checked"] = checked
    return out


def test_the_engine_serves_k_rot_with_finite_outputs(runs):
    rot = runs["rot"]
    assert torch.isfinite(rot["logprobs"]).all() and rot["logprobs"].numel() > 400
    assert all(len(t) == 20 for t in rot["cold"])


def test_a_prefix_hit_gives_the_cold_tokens(runs):
    rot = runs["rot"]
    assert all(c >= 144 for c in rot["cached"]), rot["cached"]
    assert rot["hit"] == rot["cold"]


def test_derived_positions_equal_vllms_positions(runs):
    checked = runs["positions_checked"]
    assert len(checked) > 20 and any(n > 1 for n, _ in checked)
    assert all(ok for _, ok in checked), [n for n, ok in checked if not ok]


def test_k_rot_with_b_zero_serves_what_the_policy_without_it_serves(runs):
    """Bit for bit on CPU; on a GPU the kernels with the correction are other compiled kernels,
    whose log-probs differed from those without it in the third decimal on an H100 (values
    ~-10 to -30 here)."""
    zero, none, rot = runs["zero"], runs["none"], runs["rot"]
    zero_gap = (zero["logprobs"] - none["logprobs"]).abs().max().item()
    rot_gap = (rot["logprobs"] - none["logprobs"]).abs().max().item()
    if torch.cuda.is_available():
        assert zero_gap < 5e-3, zero_gap
    else:
        assert zero_gap == 0.0, zero_gap
        assert zero["cold"] == none["cold"] and zero["hit"] == none["hit"]
    # and the rotating center is in force: a random b changes the log-probs far more
    assert rot_gap > 10 * max(zero_gap, 5e-3), rot_gap
