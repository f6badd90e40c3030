#!/usr/bin/env python3
"""Write a minimal ``vllm_nvfp4-VERSION.dist-info`` (name, version, entry points from setup.py).

For a vLLM that was not installed with pip (an unpacked offline bundle), where ``pip install -e .``
is not an option: vLLM finds plugins through ``importlib.metadata`` entry points (group
``vllm.general_plugins``), so a folder holding this dist-info on ``PYTHONPATH``, next to the
repository root, makes every process vLLM starts load the plugin.

usage: python3 scripts/plugin_dist_info.py DIR    (prints the dist-info folder it wrote)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SETUP = Path(__file__).resolve().parent.parent / "setup.py"


def setup_keywords(setup_py: Path) -> dict[str, ast.expr]:
    """The keyword arguments of the ``setup(...)`` call, unevaluated."""
    tree = ast.parse(setup_py.read_text(encoding="utf-8"))
    call = next(n for n in ast.walk(tree)
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return {k.arg: k.value for k in call.keywords if k.arg}


def write_dist_info(out_dir: Path, setup_py: Path = SETUP) -> Path:
    kw = setup_keywords(setup_py)
    version = ast.literal_eval(kw["version"])
    eps: dict[str, list[str]] = ast.literal_eval(kw["entry_points"])
    if not eps.get("vllm.general_plugins"):
        raise SystemExit(f"{setup_py} declares no vllm.general_plugins entry point")
    d = out_dir / f"vllm_nvfp4-{version}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-nvfp4\nVersion: {version}\n")
    (d / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(e.strip() + "\n" for e in items) + "\n" for group, items in eps.items()))
    (d / "top_level.txt").write_text("vllm_nvfp4\n")
    return d


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    print(write_dist_info(Path(sys.argv[1])))
