"""The calibration text shipped with the package (``builtin_text.txt``, ~3,000 English words).

Used by the start-up calibration (:mod:`vllm_nvfp4.integration.startup_calibration`) when a model
is served without a policy, and usable as ``--data`` for ``vllm-nvfp4 calibrate``.

Contents and licence:

* excerpts of the Declaration of Independence (1776), the Preamble and the first ten amendments of
  the United States Constitution (1787/1791) and the Gettysburg Address (1863): public domain;
* short pieces written for this package (a gardening guide, everyday-science questions and
  answers, a letter, notes on writing instructions, a small Python program, a history of
  time-keeping), distributed under the package's own licence.

General English prose with some lists, a letter and a little code, meant to exercise ordinary
token statistics; not a benchmark, and never held-out text.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

BUILTIN_TEXT = Path(__file__).with_name("builtin_text.txt")


def builtin_text_sha256() -> str:
    """SHA-256 of the shipped text file (part of the start-up calibration's cache key)."""
    return hashlib.sha256(BUILTIN_TEXT.read_bytes()).hexdigest()
