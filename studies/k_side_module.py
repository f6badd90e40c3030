"""Write a copy of ``vllm_nvfp4/kernels/attention.py`` whose tile loop keeps only the K side: the
scores of each tile go into a running max (no softmax, no V), the same work as the Gluon
prototypes' running-max mode. For instruction counts only (its output is meaningless):

    python -m studies.k_side_module /tmp/attention_kside.py
    PYTHONPATH=/tmp/t36:. python3 benchmarks/compile_sm90.py --module /tmp/attention_kside.py \\
        --splits 8 --configs nvfp4:64 fp8:64 [--variant none]
"""

from __future__ import annotations

import argparse
import os

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm_nvfp4", "kernels",
                      "attention.py")
#: (the text to cut out, from its first line up to and including its last line, and what replaces it)
CUTS = (
    ("        if V_FMT != FMT_FP8:\n            vss = _scales_of_tile(",
     "V_SCALE, C, BLOCK, TILE_N, MASKED, True, PARTS)\n", ""),
    ("        if USE_SOFTCAP:\n            z = s * (qk_scale / softcap)",
     "        m_i = m_new\n",
     "        m_i = tl.maximum(m_i, tl.max(s, axis=0))  # K side only\n"),
)


def k_side_source(text: str) -> str:
    """``attention.py``'s text with the V side and the softmax of the tile loop cut out."""
    for first, last, replacement in CUTS:
        start = text.find(first)
        end = text.find(last, start)
        if start < 0 or end < 0:
            raise SystemExit(f"attention.py changed: cannot find {first.strip()[:40]!r}; "
                             "update studies/k_side_module.py")
        text = text[:start] + replacement + text[end + len(last):]
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("out", help="where to write the K-side-only module")
    args = ap.parse_args()
    with open(SOURCE) as f:
        text = f.read()
    with open(args.out, "w") as f:
        f.write(k_side_source(text))


if __name__ == "__main__":
    main()
