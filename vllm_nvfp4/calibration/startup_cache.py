"""On-disk cache of start-up calibrations: one policy file per model, weights, dtype, text and recipe.

Location: ``$VLLM_NVFP4_CACHE/startup-calibration/<key>.json`` (default cache root
``$XDG_CACHE_HOME/vllm-nvfp4``, else ``~/.cache/vllm-nvfp4``). The key is the SHA-256 of a JSON
object (:func:`cache_key`) holding the model's ``config.json`` hash, a fingerprint of its weight
files (:func:`weights_fingerprint`), the model dtype, the calibration text's SHA-256 and the
calibration recipe, so a changed model, text or recipe never reuses a stale file. The file is a
normal policy file (:class:`~vllm_nvfp4.policy.KVPolicy` JSON, the key's parts in its provenance):
it can be copied into the model directory as ``nvfp4_policy.json`` to pin it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

from vllm_nvfp4 import json_text
from vllm_nvfp4.env_vars import CACHE_ENV
from vllm_nvfp4.policy import KVPolicy, PolicyError

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers

STARTUP_SUBDIR = "startup-calibration"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 1 << 20  # read from each end of a weight file that has no hub checksum
_HUB_BLOB = re.compile(r"^[0-9a-f]{64}$")  # hub cache: LFS blobs are named by their SHA-256


def cache_root() -> Path:
    """``$VLLM_NVFP4_CACHE``, else ``$XDG_CACHE_HOME/vllm-nvfp4``, else ``~/.cache/vllm-nvfp4``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "vllm-nvfp4"


def startup_cache_dir() -> Path:
    """Directory of the cached start-up calibrations."""
    return cache_root() / STARTUP_SUBDIR


def _file_digest(path: Path, size: int) -> str:
    """The hub's SHA-256 when ``path`` links to a hub blob, else SHA-256 of its first and last MiB."""
    target = path.resolve()
    if path.is_symlink() and _HUB_BLOB.match(target.name):
        return "sha256:" + target.name
    h = hashlib.sha256()
    with open(target, "rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        if size > 2 * SAMPLE_BYTES:
            f.seek(size - SAMPLE_BYTES)
        h.update(f.read(SAMPLE_BYTES))
    return "ends-sha256:" + h.hexdigest()


def weights_fingerprint(model_dir: Path) -> list[dict[str, Any]]:
    """``[{"name", "bytes", "digest"}]`` for every weight file directly in ``model_dir``.

    Cheap on any model size: the hub's own SHA-256 where the file is a hub-cache link, else a
    hash of the file's first and last MiB (safetensors headers name every tensor and offset, and
    differently initialised weights differ in both ends), always with the exact size."""
    files = sorted(p for p in Path(model_dir).iterdir()
                   if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    out = []
    for p in files:
        size = p.stat().st_size
        out.append({"name": p.name, "bytes": size, "digest": _file_digest(p, size)})
    return out


def cache_key(parts: Mapping[str, Any]) -> str:
    """SHA-256 of ``parts`` as sorted-key JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cache_path(key: str) -> Path:
    """Where the calibration with ``key`` is cached."""
    return startup_cache_dir() / f"{key}.json"


def load_cached(path: Path, num_layers: int, num_kv_heads: int, head_dim: int) -> Optional[KVPolicy]:
    """The cached policy at ``path`` if it exists and fits the model; None (with a warning when a
    file is there but unusable, so it is recalibrated and replaced) otherwise."""
    if not path.is_file():
        return None
    try:
        policy = KVPolicy.load(path)
        policy.check_model(num_layers, num_kv_heads, head_dim)
    except PolicyError as e:
        logger.warning("vllm-nvfp4: ignoring the cached start-up calibration %s (%s); "
                       "calibrating again", path, e)
        return None
    return policy


def save_cached(policy: KVPolicy, path: Path) -> Optional[Path]:
    """Write ``policy`` to ``path`` atomically (a reader never sees half a file). Returns the
    path, or None with a warning when the cache directory is not writable."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json_text.dumps(policy.to_dict()) + "\n")  # as KVPolicy.save writes it
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("vllm-nvfp4: cannot cache the start-up calibration in %s (%s); the next "
                       "start calibrates again (set $%s to a writable directory)",
                       path.parent, e, CACHE_ENV)
        return None
    return path
