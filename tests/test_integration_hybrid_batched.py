"""Batched chunked prefill of the tiny gpt-oss with ``nvfp4_mixed``: where batched and one-at-a-time runs part.

Three prompts of 112 tokens (the shared prefix of ``test_integration_hybrid.py`` and 16 own
tokens), 32-token steps: in one batch a prompt's chunks share steps with the other requests'
chunks and decodes, so vLLM's FP32 GEMMs run other shapes than one at a time and K/V differ by
FP32 rounding. A K/V element that close to an FP8 / NVFP4 rounding boundary is stored one code
apart, and the random MoE model amplifies that: on the 2-core Xeon of the results the third prompt's greedy tokens change (with
``auto`` both runs agree to FP32 rounding). The engine runs in this process; every attention call
is recorded, and the test checks that this, and not the attention, is where the runs part:

* each call of the batched run equals each of its requests attended alone on the same pages (the
  decode/prefill split, the block tables of both KV-cache groups, the window, the sinks);
* wherever a request's query and the stored bytes it sees (its positions up to the query, within
  the window) agree between the runs, its attention output agrees;
* in each request the first layer with a stored byte that differs got K/V that differ by FP32
  rounding only.
"""

from __future__ import annotations

import gc
from typing import Any, Optional

import pytest
import torch

from engine_helpers import BLOCK, PREFIX, engine, greedy, tiny_hybrid_with_policy

pytestmark = pytest.mark.vllm

OWN = 16  # own tokens after the shared prefix: 112-token prompts, seven whole blocks
NEW = 8
ROUNDING = 1e-5  # |difference| of FP32 values that differ by the order of their sums only
AGREE = 1e-4  # attention outputs computed from equal bytes and queries within ROUNDING


def _record_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Patch the impl's forward to record, per attention call, the step's layout, the layer's
    query / K / V inputs and output, the bytes stored for this step's tokens and the largest
    difference between the call's output and each request attended alone (same pages)."""
    from vllm_nvfp4.integration.backend import Nvfp4MixedImpl
    from vllm_nvfp4.paged_torch import paged_attention

    calls: list[dict[str, Any]] = []
    forward = Nvfp4MixedImpl.forward

    def recording(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw)
        m = attn_metadata
        if m is None or not hasattr(m, "query_start_loc") or kv_cache.numel() == 0:
            return result
        n, lay, cache = m.num_actual_tokens, self.layout, self._ops.cache
        qsl, lens = m.query_start_loc.tolist(), m.seq_lens.tolist()
        alone = torch.zeros_like(output[:n])
        for s in range(len(lens)):
            a, b = qsl[s], qsl[s + 1]
            if b > a:
                paged_attention(query[a:b], cache, lay, self.k_scale, self.v_scale,
                                m.block_table[s:s + 1], m.seq_lens[s:s + 1],
                                torch.tensor([0, b - a], dtype=torch.int32), b - a, lens[s],
                                self.scale, alone[a:b], self.sliding_window,
                                self.logits_soft_cap, self.sink_logits)
        slots = m.slot_mapping[:n].long()
        blocks, offsets = slots // lay.block_size, slots % lay.block_size
        stored = [lay.data_plane(cache, w)[blocks, :, offsets].flatten(1) for w in ("k", "v")]
        stored += [lay.scale_plane(cache, w)[blocks, :, offsets].flatten(1)
                   for w in ("k", "v") if lay.has_scales(w)]
        calls.append(dict(layer=int(self.layer_name.split(".")[2]), window=self.sliding_window,
                          qsl=qsl, lens=lens, q=query[:n].clone(), k=key[:n].clone(),
                          v=value[:n].clone(), out=output[:n].clone(),
                          stored=torch.cat(stored, dim=1),
                          alone=float((alone - output[:n]).abs().max())))
        return result

    monkeypatch.setattr(Nvfp4MixedImpl, "forward", recording)
    return calls


def _prefill_rows(calls: list[dict[str, Any]], request: Optional[int] = None) -> dict[tuple, dict]:
    """``(request, layer, position) -> that token's record`` of the prefill rows (several query
    tokens; vLLM keeps the requests in arrival order while they prefill). ``request``: the one
    request of a one-at-a-time run."""
    rows: dict[tuple, dict] = {}
    for c in calls:
        for s in range(len(c["lens"])):
            a, b = c["qsl"][s], c["qsl"][s + 1]
            if b - a < 2:
                continue
            first = c["lens"][s] - (b - a)
            for j in range(b - a):
                rows[(s if request is None else request, c["layer"], first + j)] = {
                    name: c[name][a + j] for name in ("q", "k", "v", "out", "stored")
                } | {"window": c["window"]}
    return rows


@pytest.fixture(scope="module")
def batched_and_alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model_dir, _ = tiny_hybrid_with_policy("gpt_oss", tmp_path_factory.mktemp("bp") / "gpt_oss",
                                           qk_gain=1.0)
    with pytest.MonkeyPatch.context() as mp:
        calls = _record_calls(mp)
        llm = engine(model_dir, enable_prefix_caching=False, max_num_batched_tokens=32,
                      max_model_len=1024)
        import inspect
        import textwrap

        ids = llm.get_tokenizer()(inspect.getsource(textwrap))["input_ids"]
        prompts = [ids[:PREFIX] + ids[2000 + 30 * i:2000 + 30 * i + OWN] for i in range(3)]
        out: dict[str, Any] = {"prompts": prompts}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(NEW), use_tqdm=False)
        out["batched_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        out["batched"] = _prefill_rows(calls)
        out["alone_max"] = max(c["alone"] for c in calls)
        out["single"], out["single_tokens"] = {}, []
        for i, p in enumerate(prompts):
            calls.clear()
            o = llm.generate([{"prompt_token_ids": p}], greedy(NEW), use_tqdm=False)[0]
            out["single_tokens"].append(list(o.outputs[0].token_ids))
            out["single"].update(_prefill_rows(calls, request=i))
        del llm
        gc.collect()
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def test_the_prompts_fill_whole_blocks_and_every_token_is_compared(batched_and_alone):
    r = batched_and_alone
    assert all(len(p) == 7 * BLOCK for p in r["prompts"])
    assert set(r["batched"]) == set(r["single"])
    assert {(key[0], key[2]) for key in r["batched"]} == {(i, p) for i in range(3) for p in range(112)}
    # the rows are assigned to the right requests: layer 0's K depends on token and position only
    assert max(_diff(r["batched"][key]["k"], r["single"][key]["k"])
               for key in r["batched"] if key[1] == 0) <= ROUNDING


def test_each_batched_call_equals_its_requests_attended_alone(batched_and_alone):
    assert batched_and_alone["alone_max"] <= ROUNDING


def test_attention_agrees_wherever_its_inputs_agree(batched_and_alone):
    b, s = batched_and_alone["batched"], batched_and_alone["single"]
    same_bytes = {key: bool(torch.equal(b[key]["stored"], s[key]["stored"])) for key in b}
    checked = 0
    for (req, layer, pos), row in b.items():
        w = row["window"]
        seen = range(0 if w is None else max(0, pos - w + 1), pos + 1)
        if _diff(row["q"], s[(req, layer, pos)]["q"]) > ROUNDING or not all(
                same_bytes[(req, layer, p)] for p in seen):
            continue
        checked += 1
        assert _diff(row["out"], s[(req, layer, pos)]["out"]) <= AGREE, (req, layer, pos)
    assert checked > len(b) // 2


def test_runs_part_at_a_stored_code_from_rounding_level_inputs(batched_and_alone):
    """Where a stored byte differs, the first layer of that request with one got K/V within FP32
    rounding of the one-at-a-time run's. Whether any byte differs depends on the CPU's GEMM code
    paths (it did on the 2-core Xeon of the results folder); where none does, there is nothing to trace."""
    r = batched_and_alone
    b, s = r["batched"], r["single"]
    flipped = sorted(key for key in b if not torch.equal(b[key]["stored"], s[key]["stored"]))
    if not flipped:
        pytest.skip("batched and one-at-a-time runs stored the same bytes on this machine")
    for req in {key[0] for key in flipped}:
        first_layer = min(key[1] for key in flipped if key[0] == req)
        for key in flipped:
            if key[:2] == (req, first_layer):
                assert max(_diff(b[key]["k"], s[key]["k"]), _diff(b[key]["v"], s[key]["v"])) <= ROUNDING, key
