#!/usr/bin/env python
"""Prepare the real model and data sets used by tests, benchmarks and docs (no model hub needed).

Usage::

    python scripts/prepare_assets.py                 # SmolLM2, Brown, GSM8K; prints {"name": "path"} as JSON
    python scripts/prepare_assets.py qwen25coder15b  # only some (Qwen is not in the default set)
    python scripts/prepare_assets.py --verify        # also greedy-generate with each prepared model

The assets, their sources and the cache directory are described in
:mod:`vllm_nvfp4.testing.assets`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable, Optional

from vllm_nvfp4.testing.assets import (ASSETS, DEFAULT_ASSETS, ENV_DIR, MODELS, asset_path, assets_dir, log,
                                       verify_model)


def main(argv: Optional[Iterable[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME",
                    help=f"assets to prepare, from {', '.join(ASSETS)} (default: {' '.join(DEFAULT_ASSETS)})")
    ap.add_argument("--dir", type=Path, default=None, help=f"cache directory (default: ${ENV_DIR} or ~/.cache/vllm-nvfp4/assets)")
    ap.add_argument("--verify", action="store_true", help="greedy-generate with each prepared model as a sanity check")
    args = ap.parse_args(list(argv) if argv is not None else None)
    unknown = [n for n in args.names if n not in ASSETS]
    if unknown:
        ap.error(f"unknown asset(s) {', '.join(unknown)}; choose from {', '.join(ASSETS)}")
    root = args.dir or assets_dir()
    paths = {}
    try:
        for name in args.names or DEFAULT_ASSETS:
            paths[name] = str(asset_path(name, root))
            log(f"{name}: {paths[name]}")
            if args.verify and name in MODELS:
                reply = verify_model(Path(paths[name]))
                log(f"{name} says: {reply!r}")
                paths[f"{name}_reply"] = reply
    except (RuntimeError, OSError) as e:
        print(f"prepare_assets: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(paths, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
