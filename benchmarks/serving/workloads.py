"""The serving workloads as ``vllm bench serve`` runs: long-context chat, shared prefixes, and the
request-rate probes of the latency-objective search.

A :class:`BenchRun` is one ``vllm bench serve`` invocation: its dataset flags, prompt count,
concurrency / rate and seed. Seeds differ between runs (the server keeps its prefix cache across
runs, so a repeated prompt would be a cache hit) and are the same for every configuration (each
configuration gets the same prompts).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Optional

WORKLOADS = ("chat", "prefix", "rate")


@dataclass(frozen=True)
class LengthRange:
    """Token lengths uniform in ``[lo, hi]``, as vLLM's random dataset draws them: ``--random-*-len``
    is the middle, ``--random-range-ratio`` the half-width over the middle."""

    lo: int
    hi: int

    @property
    def mid(self) -> int:
        return (self.lo + self.hi) // 2

    @property
    def ratio(self) -> float:
        return round((self.hi - self.lo) / (self.hi + self.lo), 6)

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2

    def __str__(self) -> str:
        """'2048-8192', as a summary's arguments and a plot's title show it."""
        return f"{self.lo}-{self.hi}"


def parse_tokens(text: str) -> int:
    """'16k' -> 16384, '300' -> 300."""
    t = text.strip().lower()
    try:
        n = int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    except ValueError:
        raise ValueError(f"a token count must look like 300 or 16k, got {text!r}") from None
    if n <= 0:
        raise ValueError(f"a token count must be positive, got {text!r}")
    return n


def parse_range(text: str) -> LengthRange:
    """'16k-32k' -> LengthRange(16384, 32768); '512' -> LengthRange(512, 512)."""
    parts = text.split("-")
    if len(parts) not in (1, 2):
        raise ValueError(f"a length range must look like 16k-32k or 512, got {text!r}")
    lo, hi = parse_tokens(parts[0]), parse_tokens(parts[-1])
    if lo > hi:
        raise ValueError(f"a length range must be low-high, got {text!r}")
    return LengthRange(lo, hi)


def parse_ints(text: str) -> list[int]:
    """'16,64' -> [16, 64] (positive integers)."""
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) <= 0:
        raise ValueError(f"expected positive integers, got {text!r}")
    return out


@dataclass(frozen=True)
class BenchRun:
    """One ``vllm bench serve`` run. ``label`` names it in records and file names."""

    workload: str
    label: str
    dataset_args: tuple[str, ...]
    num_prompts: int
    mean_input: float  # tokens per request (for time estimates)
    mean_output: float
    max_concurrency: Optional[int] = None
    request_rate: float = math.inf
    extra: dict = field(default_factory=dict, compare=False)  # recorded with the result

    @property
    def seed(self) -> int:
        return zlib.crc32(self.label.encode()) % 2**31

    @property
    def result_name(self) -> str:
        return f"{self.label}.json"

    def client_args(self) -> list[str]:
        args = list(self.dataset_args) + ["--num-prompts", str(self.num_prompts),
                                          "--request-rate", str(self.request_rate), "--seed", str(self.seed)]
        if self.max_concurrency:
            args += ["--max-concurrency", str(self.max_concurrency)]
        return args


def random_dataset(inp: LengthRange, out: LengthRange, prefix_len: int = 0) -> tuple[str, ...]:
    """vLLM's random dataset with independent input / output ranges."""
    ratio = json.dumps({"input": inp.ratio, "output": out.ratio})
    args = ("--dataset-name", "random", "--random-input-len", str(inp.mid), "--random-output-len",
            str(out.mid), "--random-range-ratio", ratio)
    return args + (("--random-prefix-len", str(prefix_len)) if prefix_len else ())


def chat_runs(a: Namespace) -> list[BenchRun]:
    """Long-context chat: random prompts of ``chat_input`` tokens, ``chat_output`` output tokens,
    one run per ``--chat-concurrency`` level with ``prompts_per_client`` x concurrency prompts."""
    return [BenchRun("chat", f"chat_c{c}", random_dataset(a.chat_input, a.chat_output),
                     max(a.min_prompts, round(a.prompts_per_client * c)), a.chat_input.mean,
                     a.chat_output.mean, max_concurrency=c, extra=dict(concurrency=c))
            for c in a.chat_concurrency]


def prefix_runs(a: Namespace) -> list[BenchRun]:
    """Shared prefixes: vLLM's ``prefix_repetition`` dataset, ``--prefix-num-prefixes`` prefixes of
    each ``--prefix-lens`` length, each shared by num_prompts / num_prefixes requests with their own
    ``--prefix-suffix-len``-token suffix; one run per prefix length and concurrency level."""
    runs = []
    for plen in a.prefix_lens:
        for c in a.prefix_concurrency:
            n = max(a.min_prompts, round(a.prompts_per_client * c), a.prefix_num_prefixes)
            n -= n % a.prefix_num_prefixes  # vLLM makes num_prompts // num_prefixes per prefix
            args = ("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(plen),
                    "--prefix-repetition-suffix-len", str(a.prefix_suffix_len),
                    "--prefix-repetition-num-prefixes", str(a.prefix_num_prefixes),
                    "--prefix-repetition-output-len", str(a.prefix_output_len))
            runs.append(BenchRun("prefix", f"prefix_p{plen}_c{c}", args, n, plen + a.prefix_suffix_len,
                                 a.prefix_output_len, max_concurrency=c,
                                 extra=dict(concurrency=c, prefix_len=plen,
                                            num_prefixes=a.prefix_num_prefixes)))
    return runs


def rate_label(rate: float) -> str:
    """The label of a rate probe, ``rate_3.557``: four significant digits, so that a rate a user
    gives (3.557) and the search's (3.5573) are one label, one seed, one set of prompts."""
    return f"rate_{rate:.4g}"


def run_key(label: str) -> str:
    """``label`` as one run's key across runs: a rate probe's by its rate (the probe's index that
    labels of earlier versions carried, ``rate_2_3.5573``, dropped: ``rate_3.557``), others as
    they are."""
    m = re.fullmatch(r"rate_(?:\d+_)?(\d+(?:\.\d+)?)", label or "")
    return rate_label(float(m.group(1))) if m else label


def rate_run(a: Namespace, rate: float, index: int) -> BenchRun:
    """Probe ``index`` of the rate search: the chat lengths at ``rate`` requests/s (Poisson
    arrivals), ``--probe-s`` seconds of arrivals (at least ``--min-prompts`` requests), no
    concurrency cap. Its seed follows the rate (:func:`rate_label`), not the probe's index: every
    configuration probed at a rate gets the same prompts and arrival times."""
    n = max(a.min_prompts, math.ceil(rate * a.probe_s))
    return BenchRun("rate", rate_label(rate), random_dataset(a.chat_input, a.chat_output), n,
                    a.chat_input.mean, a.chat_output.mean, request_rate=rate,
                    extra=dict(rate=rate, probe=index))


def longest_request(a: Namespace) -> int:
    """Prompt + output tokens of the longest request any selected workload sends."""
    n = 0
    if {"chat", "rate"} & set(a.workloads):
        n = max(n, a.chat_input.hi + a.chat_output.hi)
    if "prefix" in a.workloads:
        n = max(n, max(a.prefix_lens) + a.prefix_suffix_len + a.prefix_output_len)
    return n
