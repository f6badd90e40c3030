"""The soak's request set: deterministic from its parameters, rebuilt by every pass.

Prompt lengths are drawn log-uniformly (or uniformly) in ``[lo, hi]`` tokens; a ``prefix_fraction``
of the requests start with one of ``num_prefixes`` shared prefixes (each ``prefix_len`` tokens,
clipped to the request's length), and a ``spec_fraction`` are speculative: their prompts repeat a
short random segment, so ngram drafts find matches. Output lengths are uniform in ``output``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from benchmarks.serving.workloads import LengthRange

FIRST_TOKEN = 10  # ids below this are left out (special tokens of small vocabularies)


@dataclass(frozen=True)
class SoakParams:
    """Everything the request set depends on (recorded in every pass's spec)."""

    num_requests: int
    prompt: LengthRange
    output: LengthRange
    prefix_len: LengthRange
    prefix_fraction: float
    num_prefixes: int
    spec_fraction: float
    vocab: int
    seed: int = 0
    loguniform: bool = True


@dataclass(frozen=True)
class SoakRequest:
    """One request: ``prefix`` is the index of its shared prefix (-1: none)."""

    id: int
    prompt: tuple[int, ...]
    max_tokens: int
    prefix: int
    spec: bool


def _length(rng: random.Random, r: LengthRange, loguniform: bool) -> int:
    if loguniform:
        return min(r.hi, max(r.lo, int(math.exp(rng.uniform(math.log(r.lo), math.log(r.hi + 1))))))
    return rng.randint(r.lo, r.hi)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


def make_requests(p: SoakParams) -> list[SoakRequest]:
    """The ``p.num_requests`` requests of :class:`SoakParams` ``p`` (same list for the same ``p``)."""
    if not 0 <= p.prefix_fraction <= 1 or not 0 <= p.spec_fraction <= 1:
        raise ValueError("prefix_fraction and spec_fraction must be in [0, 1]")
    if p.vocab <= FIRST_TOKEN + 1 or p.num_requests <= 0 or p.num_prefixes <= 0:
        raise ValueError("need num_requests > 0, num_prefixes > 0 and a vocabulary of more than "
                         f"{FIRST_TOKEN + 1} tokens")
    rng = random.Random(p.seed)
    prefixes = [_tokens(rng, rng.randint(p.prefix_len.lo, p.prefix_len.hi), p.vocab)
                for _ in range(p.num_prefixes)]
    out = []
    for i in range(p.num_requests):
        n = _length(rng, p.prompt, p.loguniform)
        spec = rng.random() < p.spec_fraction
        prefix = rng.randrange(p.num_prefixes) if rng.random() < p.prefix_fraction else -1
        head = prefixes[prefix][:n] if prefix >= 0 else []
        if spec:  # a repeated segment after the prefix: ngram lookups hit it
            seg = _tokens(rng, rng.randint(8, 32), p.vocab)
            body = (seg * (n // len(seg) + 1))[:n - len(head)]
        else:
            body = _tokens(rng, n - len(head), p.vocab)
        out.append(SoakRequest(i, tuple(head + body), rng.randint(p.output.lo, p.output.hi), prefix, spec))
    return out
