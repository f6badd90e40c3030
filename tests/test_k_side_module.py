"""benchmarks/k_side_module.py: its cuts still find today's tile loop, and the cut loop keeps the
K side (the K planes and their dot) without the softmax or the V side."""

from benchmarks.k_side_module import SOURCE, k_side_source


def test_k_side_cuts_match_the_attention_source():
    with open(SOURCE) as f:
        text = f.read()
    cut = k_side_source(text)
    loop = cut[cut.index("def _attend_tiles("):cut.index("def _rescale(")]
    assert "m_i = tl.maximum(m_i, tl.max(s, axis=0))  # K side only" in loop
    assert "kps = _planes(" in loop and "vps = _planes(" not in loop
    assert "tl.exp2(" not in loop and "V_SCALE, C, BLOCK" not in loop
