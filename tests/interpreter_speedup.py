"""Faster Triton interpreter runs (``TRITON_INTERPRET=1``) for the CPU test suite.

The interpreter patches ``triton.language`` for the whole launch of a kernel, and then again on
every call of a nested ``@triton.jit`` function, where each patch walks every member of
``tl``, ``tl.tensor`` and ``tl.math`` (``inspect.getmembers``) only to find them patched already.
With the kernels' many small helpers that re-patching was ~28% of a cache-write launch
(``cProfile``: 46 of 163 s). :func:`install` lets a nested call skip it while the launch's patch
of the same language modules holds; the launch still patches and restores as before, so the
kernels run the same interpreted operations.
"""

from __future__ import annotations

import inspect
import sys

#: attribute set on each language module while a launch's patch of it holds
_MARK = "_nvfp4_tests_patched"


#: function -> the ``triton.language`` modules among its globals
_LANGS: dict = {}


def _language_modules(fn) -> list:
    """The ``triton.language`` modules the interpreter patches for ``fn`` (its globals')."""
    import triton.language as tl

    if fn not in _LANGS:
        _LANGS[fn] = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
    return _LANGS[fn]


def install() -> bool:
    """Replace the interpreter's ``_patch_lang`` with one that skips nested calls; False (nothing
    changed) where no kernel was built for the interpreter or this Triton lacks the internals it
    wraps. Call it after the test modules are imported: importing Triton before they set
    ``TRITON_INTERPRET`` would build its own ``@jit`` helpers (``tl.zeros``, ...) for the GPU."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is None:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_cls is None or getattr(original, "_skips_nested", False):
        return False

    def patch_lang(fn):
        langs = _language_modules(fn)
        if langs and all(getattr(m, _MARK, False) for m in langs):
            return scope_cls()  # nested: the enclosing launch's patch holds
        scope = original(fn)
        for m in langs:  # removed with the launch's patches by scope.restore()
            scope.set_attr(m, _MARK, True)
        return scope

    patch_lang._skips_nested = True
    interpreter._patch_lang = patch_lang
    return True
