"""Build a model directory once: the marker-checked cache every random-model builder shares.

A directory holds a marker file with its build arguments, and a call with the same arguments
returns at once. Without ``out_dir`` a model goes to ``$VLLM_NVFP4_CACHE`` (default
``~/.cache/vllm-nvfp4``) under a name derived from the arguments.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional, Union

from vllm_nvfp4.testing.tokenizers import atomic_dir, cache_root

BUILD_VERSION = 1  # bump when the output of a given argument set changes
MARKER = "tiny_model.json"


def cached_build(out_dir: Optional[Union[str, os.PathLike]], args: dict[str, Any], name: str,
                  build: Callable[[Path], None]) -> Path:
    """The model directory for the build arguments ``args``: reused when its marker matches,
    else (re)built by ``build(tmp_dir)``; ``out_dir=None``: ``name-<hash of args>`` under
    :func:`cache_root`. Refuses to replace a non-empty directory it did not make."""
    if out_dir is None:
        digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:10]
        out = cache_root() / "models" / f"{name}-{digest}"
    else:
        out = Path(out_dir)
    marker = out / MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == args:
                return out
        except (OSError, ValueError):
            pass
    if out.exists() and any(out.iterdir()) and not marker.exists():
        raise FileExistsError(f"{out} exists, is not empty and was not made by a tiny-model builder")

    def build_marked(tmp: Path) -> None:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps(args, indent=2, sort_keys=True))

    if out.exists():  # stale build with other arguments: rebuild in place
        shutil.rmtree(out)
    return atomic_dir(out, build_marked, MARKER)
