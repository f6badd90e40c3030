#!/usr/bin/env python
"""Accuracy of KV-cache configurations through vLLM: the command line of
:mod:`vllm_nvfp4.evaluation.accuracy` (``--help`` describes it).

    python scripts/eval_accuracy.py MODEL_DIR --policy POLICY.json --out DIR [options]
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_nvfp4.evaluation.accuracy import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
