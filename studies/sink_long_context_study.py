#!/usr/bin/env python
"""Does the sink key's store decide long-context retrieval (CPU)? Passkey through the reference path.

    python -m studies.sink_long_context_study MODEL --policy POLICY.json --out DIR
        [--context 8176] [--trials 10] [--dtype float32]

Passkey prompts as ``scripts/eval_accuracy.py`` builds them (:mod:`vllm_nvfp4.evaluation.passkey`:
trial ``i`` at depth ``spread_depths(trials)[i]``, starting with the tokenizer's served prefix
``i``), each scored teacher-forced in transformers with the cache fake-quantized
(:mod:`vllm_nvfp4.calibration.kv_hooks`) five ways:

* ``unquantized``: no quantization;
* ``served``: POLICY as vLLM serves it (the first key stored uncentered in the heads its
  ``k_sink_uncentered`` flags);
* ``centered``: POLICY with every sink key centered (:func:`~vllm_nvfp4.calibration.sink_choice.without_sink_key`);
* ``centered + first key exact`` / ``centered + first key FP8``: the same, with position 0 of
  every NVFP4-K layer unquantized / FP8 (:class:`~studies.kv_options.KeySink`).

If only the sink key's quantization error mattered, the exact first key would retrieve best.
Writes ``DIR/sink_long_context.json`` (per configuration: pass count, mean answer log-prob, every
trial) and ``DIR/sink_long_context.md``; prints a line per trial.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Optional, Sequence

#: configuration -> (policy variant: None / "served" / "centered", first-key store of KeySink)
CONFIGS: dict[str, tuple[Optional[str], Optional[str]]] = {
    "unquantized": (None, None),
    "served": ("served", None),
    "centered": ("centered", None),
    "centered + first key exact": ("centered", "exact"),
    "centered + first key FP8": ("centered", "fp8"),
}


def answer_score(model: Any, token_ids: Sequence[int], answer: Sequence[int]) -> tuple[float, bool]:
    """``(answer log-prob in nats, passes)`` of a prompt whose last ``len(answer)`` tokens are the
    answer: teacher-forced, a pass when the argmax is the answer token at every answer position
    (the condition for greedy decoding to emit it)."""
    import torch

    ids = torch.tensor([list(token_ids)])
    with torch.no_grad():
        logits = model(ids, logits_to_keep=len(answer) + 1).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1)
    want = torch.tensor(list(answer))
    return float(lp.gather(1, want[:, None]).sum()), bool((lp.argmax(-1) == want).all())


def run(model: Any, tokenizer: Any, policy: Any, context: int, trials: int) -> dict[str, Any]:
    """Every trial in every configuration of :data:`CONFIGS`; per configuration ``correct``,
    ``mean_answer_logprob`` and ``trials`` (depth, prompt tokens, answer log-prob, correct)."""
    from studies.kv_options import KeySink
    from vllm_nvfp4.calibration.kv_hooks import kv_cache_quantization
    from vllm_nvfp4.calibration.sink_choice import without_sink_key
    from vllm_nvfp4.evaluation import passkey

    policies = {"served": policy, "centered": without_sink_key(policy)}
    prompts = passkey.build_trials(tokenizer, context, passkey.spread_depths(trials))
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    t0 = time.time()
    for t in prompts:
        line = []
        for name, (variant, store) in CONFIGS.items():
            options = () if store is None else (KeySink(1, store),)
            with kv_cache_quantization(model, None if variant is None else policies[variant], options=options):
                logprob, correct = answer_score(model, t.token_ids, t.answer_token_ids)
            rows[name].append({"depth": t.depth, "prompt_tokens": len(t.prompt_token_ids),
                               "answer_logprob": round(logprob, 4), "correct": correct})
            line.append(f"{name} {logprob:.2f}")
        print(f"depth {t.depth} ({len(t.token_ids)} tokens, {time.time() - t0:.0f} s): "
              + ", ".join(line), flush=True)
    return {name: {"correct": sum(r["correct"] for r in rs),
                   "mean_answer_logprob": round(sum(r["answer_logprob"] for r in rs) / len(rs), 4),
                   "trials": rs} for name, rs in rows.items()}


def table(results: dict[str, Any]) -> str:
    """Markdown: per configuration, passes, mean answer log-prob and the trials where it is
    below ``centered``'s."""
    ref = [r["answer_logprob"] for r in results["centered"]["trials"]]
    lines = ["| configuration | passes | mean answer log-prob | trials below `centered` |",
             "|---|---:|---:|---:|"]
    for name, res in results.items():
        below = sum(r["answer_logprob"] < c for r, c in zip(res["trials"], ref))
        n = len(res["trials"])
        lines.append(f"| {name} | {res['correct']}/{n} | {res['mean_answer_logprob']:.2f} | "
                     f"{'-' if name == 'centered' else f'{below}/{n}'} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--policy", type=Path, required=True, help="a KV policy with sink-key flags")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--context", type=int, default=8176, help="tokens per prompt, answer included")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args(argv)
    if a.trials < 1:
        ap.error("--trials must be at least 1")
    import torch

    from vllm_nvfp4.calibration.modeling import load_model
    from vllm_nvfp4.policy.kv_policy import KVPolicy

    written = a.out / "sink_long_context.json"
    if written.exists():
        ap.error(f"{written} exists: pass another --out (a run is not overwritten)")
    policy = KVPolicy.load(a.policy)
    if all(lp.k_sink_uncentered is None for lp in policy.layers):
        ap.error(f"{a.policy} flags no sink key (k_sink_uncentered): served and centered would be the same")
    torch.manual_seed(0)
    model, tokenizer, _ = load_model(a.model, a.dtype, "cpu")
    positions = getattr(model.config, "max_position_embeddings", None)
    if a.context < 64 or (positions is not None and a.context > positions):
        ap.error(f"--context {a.context}: passkey prompts need 64 to {positions} tokens on this model")
    results = run(model, tokenizer, policy, a.context, a.trials)
    a.out.mkdir(parents=True, exist_ok=True)
    written.write_text(json.dumps(
        {"model": str(a.model), "policy": str(a.policy), "context": a.context, "dtype": a.dtype,
         "configs": results}, indent=1) + "\n")
    md = table(results)
    (a.out / "sink_long_context.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
