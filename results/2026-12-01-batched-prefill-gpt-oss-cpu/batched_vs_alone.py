"""Three 112-token prompts (96 shared + 16 own tokens) in 32-token steps, in one batch vs one at
a time: one JSON line of log-prob differences and, for nvfp4_mixed, of the first stored bytes
that differ per request (the recording of tests/test_integration_hybrid_batched.py).

usage: python batched_vs_alone.py --arch gpt_oss|mistral --dtype nvfp4_mixed|auto
"""

import argparse
import inspect
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
             "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from test_integration_hybrid_batched import OWN, _prefill_rows, _record_calls  # noqa: E402
from test_integration_hybrid import PREFIX, _engine, _policy_text  # noqa: E402
from vllm_nvfp4.policy import KVPolicy, layer_types_from_config  # noqa: E402
from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--arch", default="gpt_oss")
ap.add_argument("--dtype", default="nvfp4_mixed")
args = ap.parse_args()
model_dir = build_tiny_hybrid(args.arch, Path(tempfile.mkdtemp()) / args.arch,
                              qk_gain=1.0 if args.arch == "gpt_oss" else 2.0)
types = layer_types_from_config(AutoConfig.from_pretrained(model_dir).get_text_config())
policy = KVPolicy.from_compact(_policy_text(types), len(types), layer_types=types)
(model_dir / "nvfp4_policy.json").write_text(json.dumps(policy.to_dict()))

from vllm import SamplingParams  # noqa: E402

with pytest.MonkeyPatch.context() as mp:
    calls = _record_calls(mp)
    llm = _engine(model_dir, kv_cache_dtype=args.dtype, enable_prefix_caching=False,
                  max_num_batched_tokens=32, max_model_len=1024)
    ids = llm.get_tokenizer()(inspect.getsource(textwrap))["input_ids"]
    prompts = [ids[:PREFIX] + ids[2000 + 30 * i:2000 + 30 * i + OWN] for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)

    def generate(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        return [(list(o.outputs[0].token_ids),
                 [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]

    batched = generate(prompts)
    rows_b, alone_max = _prefill_rows(calls), max((c["alone"] for c in calls), default=None)
    single, rows_s = [], {}
    for i, p in enumerate(prompts):
        calls.clear()
        single += generate([p])
        rows_s.update(_prefill_rows(calls, request=i))

result = {"arch": args.arch, "kv_cache_dtype": args.dtype, "prompt_tokens": len(prompts[0]),
          "batched_call_vs_requests_alone_max_abs": alone_max, "requests": []}
for i in range(3):
    (tb, lb), (ts, ls) = batched[i], single[i]
    same = next((j for j, (u, w) in enumerate(zip(tb, ts)) if u != w), len(tb))  # first differing
    flips = []
    for key in sorted(k for k in rows_b if k[0] == i):
        b, s = rows_b[key], rows_s[key]
        if not torch.equal(b["stored"], s["stored"]):
            flips.append({"layer": key[1], "position": key[2],
                          "bytes_differing": int((b["stored"] != s["stored"]).sum()),
                          "kv_input_max_abs_diff": max(float((b[n] - s[n]).abs().max()) for n in "kv")})
    first_layer = min((f["layer"] for f in flips), default=None)
    result["requests"].append({
        "greedy_tokens_equal": tb == ts,
        "first_token_logprob_abs_diff": abs(lb[0] - ls[0]),
        "equal_leading_tokens": same,
        "max_logprob_abs_diff_over_equal_leading_tokens": max(
            (abs(x - y) for x, y in zip(lb[:same], ls[:same])), default=0.0),
        "prefill_rows_with_differing_bytes": len(flips),
        "first_layer_with_differing_bytes": [f for f in flips if f["layer"] == first_layer],
        "earliest_position_with_differing_bytes": min(flips, key=lambda f: f["position"], default=None),
    })
print(json.dumps(result))
