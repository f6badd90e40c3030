"""The fork-style source patch: up to date, applies cleanly to the installed vLLM 0.32.0, and
mirrors the plugin's hook list (same hooks, same files, same vllm-nvfp4 entry points)."""

from __future__ import annotations

import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "patches"))

import generate_patch  # noqa: E402

from vllm_nvfp4.integration.hooks import HOOKS  # noqa: E402

PATCH = REPO / "patches" / generate_patch.PATCH_NAME


@pytest.fixture(scope="module")
def vllm_dir() -> Path:
    from importlib.metadata import version

    if not version("vllm").startswith(generate_patch.VLLM_VERSION):
        pytest.skip(f"installed vLLM {version('vllm')} is not {generate_patch.VLLM_VERSION}")
    return generate_patch.installed_vllm_dir()


@pytest.fixture()
def source_copy(vllm_dir: Path, tmp_path: Path) -> Path:
    """The files the patch touches, copied from the installed vLLM into ``tmp/vllm/...``."""
    for file in {e.file for e in generate_patch.EDITS}:
        dst = tmp_path / file
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(vllm_dir.parent / file, dst)
    return tmp_path


def test_committed_patch_is_up_to_date(vllm_dir):
    assert PATCH.read_text() == generate_patch.generate(vllm_dir), (
        "regenerate: python patches/generate_patch.py > patches/" + generate_patch.PATCH_NAME)


def test_patch_applies_cleanly_and_compiles(source_copy):
    for cmd in (["git", "apply", "--check", str(PATCH)],
                ["patch", "-p1", "--dry-run", "-i", str(PATCH)],
                ["patch", "-p1", "-i", str(PATCH)]):
        run = subprocess.run(cmd, cwd=source_copy, capture_output=True, text=True)
        assert run.returncode == 0, f"{' '.join(cmd)}:\n{run.stdout}{run.stderr}"
        assert "offset" not in run.stdout and "fuzz" not in run.stdout, run.stdout
    for file in {e.file for e in generate_patch.EDITS}:
        py_compile.compile(str(source_copy / file), doraise=True)
        assert '"nvfp4_mixed"' in (source_copy / file).read_text()


def test_patch_mirrors_the_hook_list():
    from_hooks = {(h.name, f) for h in HOOKS for f in h.patch_files}
    from_edits = {(e.hook, e.file) for e in generate_patch.EDITS}
    assert from_edits == from_hooks
    entries = {h.name: h.entry for h in HOOKS}
    for e in generate_patch.EDITS:
        assert '"nvfp4_mixed"' in e.insert, e  # inert unless the dtype is used
        imported = re.findall(r"from vllm_nvfp4\.[\w.]+ import (\w+)", e.insert)
        assert imported in ([], [entries[e.hook]]), (e.hook, imported)
        assert imported or e.hook == "cache_dtype", f"{e.hook}: the patch must call {entries[e.hook]}"
