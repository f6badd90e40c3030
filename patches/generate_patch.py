"""Generate ``vllm-0.32.0-nvfp4_mixed.patch``: the plugin's hooks as edits of vLLM's sources.

For people who build vLLM themselves (fork style) instead of loading the plugin. Each edit below
belongs to one hook of :data:`vllm_nvfp4.integration.hooks.HOOKS` (same name) and makes vLLM call
the same vllm-nvfp4 function the hook calls; vllm-nvfp4 is imported only when
``kv_cache_dtype == "nvfp4_mixed"``, so a patched vLLM without the package behaves as before.
``tests/test_integration_patches.py`` regenerates the patch from the installed vLLM 0.32.0, checks
that it equals the committed file and applies cleanly, and that every hook with ``patch_files``
has its edit here (and no edit lacks a hook).

    python patches/generate_patch.py [VLLM_PACKAGE_DIR] > patches/vllm-0.32.0-nvfp4_mixed.patch
    cd vllm-src && patch -p1 < .../vllm-0.32.0-nvfp4_mixed.patch     # or: git apply
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import NamedTuple

PATCH_NAME = "vllm-0.32.0-nvfp4_mixed.patch"
VLLM_VERSION = "0.32.0"


class Edit(NamedTuple):
    hook: str  # name of the hook in vllm_nvfp4.integration.hooks.HOOKS
    file: str  # path inside the vLLM source tree
    anchor: str  # unique text; the insertion goes right after it
    insert: str


EDITS: tuple[Edit, ...] = (
    Edit("cache_dtype", "vllm/config/cache.py",
         '    "nvfp4_4over6",\n',
         '    "nvfp4_mixed",  # vllm-nvfp4: per-layer FP8/NVFP4 (vllm_nvfp4.integration)\n'),
    Edit("cache_dtype", "vllm/utils/torch_utils.py",
         '    "nvfp4_4over6": torch.uint8,\n',
         '    "nvfp4_mixed": torch.uint8,  # vllm-nvfp4: opaque pages, layout in vllm_nvfp4.layout\n'),
    Edit("backend_selection", "vllm/v1/attention/selector.py",
         "    from vllm.platforms import current_platform\n\n",
         "    if attn_selector_config.kv_cache_dtype == \"nvfp4_mixed\":\n"
         "        from vllm_nvfp4.integration.backend_choice import select_backend\n\n"
         "        return resolve_obj_by_qualname(select_backend(backend, attn_selector_config))\n\n"),
    Edit("spec", "vllm/model_executor/layers/attention/attention.py",
         "    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:\n",
         "        if self.kv_cache_dtype == \"nvfp4_mixed\":\n"
         "            from vllm_nvfp4.integration.kv_cache_spec import kv_cache_spec\n\n"
         "            return kv_cache_spec(self, vllm_config)\n"),
    Edit("startup_check", "vllm/engine/arg_utils.py",
         "            shutdown_timeout=self.shutdown_timeout,\n        )\n\n",
         "        if config.cache_config.cache_dtype == \"nvfp4_mixed\":\n"
         "            from vllm_nvfp4.integration.model import check_engine_config\n\n"
         "            check_engine_config(config)\n\n"),
    Edit("state_alignment", "vllm/platforms/interface.py",
         '        """For hybrid attention/mamba models, ensure that the attention page\n'
         '        size is >= the mamba page size, and pad the mamba page size to match.\n'
         '        """\n',
         "        if vllm_config.cache_config.cache_dtype == \"nvfp4_mixed\":\n"
         "            from vllm_nvfp4.integration.state_alignment import aligning_backend\n\n"
         "            backend_cls = aligning_backend(vllm_config, backend_cls)\n\n"),
    Edit("startup_calibration", "vllm/v1/executor/abstract.py",
         "    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:\n",
         "        if self.vllm_config.cache_config.cache_dtype == \"nvfp4_mixed\":\n"
         "            from vllm_nvfp4.integration.startup_calibration import calibrate_engine\n\n"
         "            calibrate_engine(self)\n"),
)


def installed_vllm_dir() -> Path:
    """The directory of the importable ``vllm`` package (its parent is the source root)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vllm is not installed; pass the vllm package directory")
    return Path(spec.origin).parent


def apply_edits(text: str, edits: list[Edit]) -> str:
    """``text`` with each edit inserted after its (unique) anchor."""
    for e in edits:
        if text.count(e.anchor) != 1:
            raise ValueError(f"{e.file}: anchor for hook {e.hook!r} found {text.count(e.anchor)} "
                             f"times (expected once); is this vLLM {VLLM_VERSION}?")
        i = text.index(e.anchor) + len(e.anchor)
        text = text[:i] + e.insert + text[i:]
    return text


def generate(vllm_dir: Path) -> str:
    """The unified diff (``a/`` and ``b/`` prefixes, ``patch -p1``) of all edits."""
    root = vllm_dir.parent
    chunks = []
    for file in sorted({e.file for e in EDITS}):
        old = (root / file).read_text(encoding="utf-8")
        new = apply_edits(old, [e for e in EDITS if e.file == file])
        chunks.extend(difflib.unified_diff(old.splitlines(keepends=True),
                                           new.splitlines(keepends=True),
                                           f"a/{file}", f"b/{file}", n=3))
    return "".join(chunks)


if __name__ == "__main__":
    sys.stdout.write(generate(Path(sys.argv[1]) if len(sys.argv) > 1 else installed_vllm_dir()))
