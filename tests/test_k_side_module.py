"""studies/k_side_module.py: the cut module parses, differs from ``attention.py`` only in the tile
loop, and that loop computes the K side alone (the K planes, their scales and dot, a running max)
without the softmax or the V side; a kernel it cannot cut is a clear error."""

import ast

import pytest

from studies.k_side_module import SOURCE, k_side_source


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _calls(fn: ast.FunctionDef) -> list[str]:
    """The dotted names of every call in ``fn`` (``tl.exp2``, ``_planes``), in order."""
    return [ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)]


def _assigned(fn: ast.FunctionDef) -> dict[str, list[ast.expr]]:
    out: dict[str, list[ast.expr]] = {}
    for n in ast.walk(fn):
        if isinstance(n, (ast.Assign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        out.setdefault(name.id, []).append(n.value)
    return out


@pytest.fixture(scope="module")
def trees():
    with open(SOURCE) as f:
        text = f.read()
    return ast.parse(text), ast.parse(k_side_source(text))


def test_only_the_tile_loop_changes(trees):
    full, cut = (_functions(t) for t in trees)
    assert full.keys() == cut.keys()
    changed = [name for name in full if ast.dump(full[name]) != ast.dump(cut[name])]
    assert changed == ["_attend_tiles"]


def test_the_cut_loop_keeps_the_k_side_only(trees):
    full, cut = (_functions(t)["_attend_tiles"] for t in trees)
    full_calls, cut_calls = _calls(full), _calls(cut)
    # K and V planes and scales in the kernel; the K ones alone in the cut
    assert full_calls.count("_planes") == 2 and cut_calls.count("_planes") == 1
    assert full_calls.count("_scales_of_tile") == 2 and cut_calls.count("_scales_of_tile") == 1
    assert full_calls.count("_fp8_planes") == 2 and cut_calls.count("_fp8_planes") == 1
    assert "_dot_f" in cut_calls  # the K . q^T dot stays
    for softmax in ("tl.exp2", "tl.exp", "_rescale", "tl.where"):
        assert softmax in full_calls and softmax not in cut_calls
    assigned = _assigned(cut)
    assert "accs" not in assigned and "p" not in assigned  # no V accumulation, no probabilities
    (m_i,) = assigned["m_i"]  # the running max of the scores, nothing else
    assert isinstance(m_i, ast.Call) and ast.unparse(m_i.func) == "tl.maximum"
    assert ast.unparse(m_i.args[1]) == "tl.max(s, axis=0)"
    assert isinstance(cut.body[-1], ast.Return)


def test_a_kernel_it_cannot_cut_is_a_clear_error():
    with pytest.raises(SystemExit, match="attention.py changed: cannot find .*k_side_module"):
        k_side_source("def _attend_tiles():\n    pass\n")
