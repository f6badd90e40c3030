"""Passkey retrieval (Mohtashami & Jaggi, 2023): find a 5-digit key hidden in long filler text.

The prompt is the standard one: an instruction, filler sentences repeated to the target length,
the key sentence inserted at a given depth (0 = start, 1 = end of the filler), then the question
ending in ``The pass key is``. Errors in the KV cache grow with context, and retrieving an exact
string from far back is the first thing a damaged cache loses.

Scored teacher-forced, in one prefill: the answer tokens (`` 12345`` as the tokenizer splits it)
are appended to the prompt and vLLM returns each position's log-prob and argmax
(``prompt_logprobs``). A trial *passes* when the argmax is the answer token at every answer
position - exactly the condition for greedy decoding to emit the key (token for token) - and the
summed log-prob of the answer is reported as a continuous measure. Why not generate: a decode step
on the CPU path re-reads the whole context, so 4k-token generations would dominate the run time;
the teacher-forced check gives the same pass/fail for greedy decoding at the cost of one prefill.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from vllm_nvfp4.calibration.data import served_prefixes
from vllm_nvfp4.evaluation.logprobs import WindowScores

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about the important information there.\n\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyTrial:
    """One prompt: its token ids, the answer's token ids, the key, the depth it sits at."""

    key: str
    depth: float
    prompt_token_ids: tuple[int, ...]
    answer_token_ids: tuple[int, ...]

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the answer: what is scored teacher-forced."""
        return [*self.prompt_token_ids, *self.answer_token_ids]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "depth": self.depth, "prompt_tokens": len(self.prompt_token_ids),
                "answer_tokens": len(self.answer_token_ids)}


def spread_depths(n: int) -> list[float]:
    """``n`` needle depths spread evenly over 0.1..0.9 (three decimals; one trial: 0.1)."""
    return [round(0.1 + 0.8 * i / max(n - 1, 1), 3) for i in range(n)]


def build_trials(tokenizer: Any, context_tokens: int, depths: Sequence[float], seed: int = 0) -> list[PasskeyTrial]:
    """One trial per depth, prompt plus answer about ``context_tokens`` tokens (never longer).

    Trial ``i`` starts with the tokenizer's ``served_prefixes()[i % len]`` (as completions or chat
    requests start).
    """
    if context_tokens < 64:
        raise ValueError(f"passkey context must be at least 64 tokens, got {context_tokens}")
    rng = random.Random(seed)

    def n_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    prefixes = served_prefixes(tokenizer)
    unit = n_tokens(FILLER * 8) / 8
    trials = []
    for i, depth in enumerate(depths):
        prefix = list(prefixes[i % len(prefixes)])
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must lie in [0, 1], got {depth}")
        key = str(rng.randrange(10000, 100000))
        answer = tuple(tokenizer(" " + key, add_special_tokens=False)["input_ids"])
        fixed = len(prefix) + n_tokens(INSTRUCTION + NEEDLE.format(key=key) + QUESTION) + len(answer)
        units = max(int((context_tokens - fixed) / unit), 1)
        while True:
            before = round(depth * units)
            text = INSTRUCTION + FILLER * before + NEEDLE.format(key=key) + FILLER * (units - before) + QUESTION
            ids = prefix + list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(ids) + len(answer) <= context_tokens or units == 1:
                break
            units -= 1
        trials.append(PasskeyTrial(key=key, depth=depth, prompt_token_ids=tuple(ids), answer_token_ids=answer))
    return trials


def score(trials: Sequence[PasskeyTrial], scores: Sequence[WindowScores]) -> dict[str, Any]:
    """Pass/fail (greedy would emit the key) and answer log-prob per trial, from teacher forcing.

    ``scores[i]`` are the prompt log-prob scores of ``trials[i].token_ids``.
    """
    if len(trials) != len(scores):
        raise ValueError(f"{len(trials)} trials but {len(scores)} scored prompts")
    rows = []
    for t, s in zip(trials, scores):
        m = len(t.answer_token_ids)
        if len(s.nll) != len(t.token_ids) - 1:
            raise ValueError(f"trial at depth {t.depth}: scores cover {len(s.nll)} positions, expected {len(t.token_ids) - 1}")
        top1 = s.top1[-m:]
        rows.append({**t.to_dict(), "correct": tuple(top1) == t.answer_token_ids,
                     "answer_tokens_top1": sum(a == b for a, b in zip(top1, t.answer_token_ids)),
                     "answer_logprob": round(-sum(s.nll[-m:]), 6)})
    correct = sum(r["correct"] for r in rows)
    return {"accuracy": correct / len(rows) if rows else 0.0, "correct": correct,
            "mean_answer_logprob": round(sum(r["answer_logprob"] for r in rows) / len(rows), 6) if rows else None,
            "trials": rows}
