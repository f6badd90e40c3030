"""Local tokenizers for random test models: nothing is downloaded.

* :func:`train_tokenizer`: a byte-level BPE trained with ``tokenizers`` on the local Python
  standard library sources, cached under :func:`cache_root` by vocabulary size.
* :func:`write_byte_tokenizer`: a byte-level BPE with no merges (one token per byte) padded with
  placeholder tokens up to a model's vocabulary, so every id a random model samples decodes.
* :func:`save_tokenizer`: a trained tokenizer written into a model directory with
  :data:`CHAT_TEMPLATE`.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable

from vllm_nvfp4.calibration.startup_cache import cache_root  # the package's one cache root

TOKENIZER_VERSION = 1  # bump when the trained tokenizer of a given vocabulary changes
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3 (bos 1, eos 2)
BYTE_SPECIAL_TOKENS = SPECIAL_TOKENS[:3]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _corpus_files(text_mb: float) -> list[str]:
    """Sorted stdlib ``*.py`` files (site-packages excluded) adding up to about ``text_mb`` MB."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files, size = [], 0
    for f in sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)):
        if "site-packages" in f or "dist-packages" in f:
            continue
        files.append(f)
        size += os.path.getsize(f)
        if size > text_mb * 1e6:
            break
    if not files:
        raise RuntimeError(f"no Python sources found under {stdlib} to train the tokenizer on")
    return files


def atomic_dir(final: Path, build: Callable[[Path], None], marker: str) -> Path:
    """Run ``build(tmp_dir)`` and move the result to ``final``; safe against concurrent builders
    (``marker``: the file a finished build holds)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, final)
        except OSError:  # someone else finished first (final exists and is not empty)
            if not (final / marker).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def train_tokenizer(vocab: int = 4096, text_mb: float = 2.0) -> Path:
    """Train (or reuse from the cache) a byte-level BPE tokenizer; returns the ``tokenizer.json`` path.

    ``vocab`` is the target vocabulary size (special tokens included); the trained vocabulary can
    be a little smaller when the corpus runs out of merges.
    """
    if vocab < 512:
        raise ValueError(f"vocab must be >= 512 (byte alphabet + merges), got {vocab}")
    key = f"bpe-v{TOKENIZER_VERSION}-{vocab}-{text_mb:g}mb"
    final = cache_root() / "tokenizers" / key
    path = final / "tokenizer.json"
    if path.exists():
        return path

    def build(tmp: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train(_corpus_files(text_mb), trainer)
        tok.save(str(tmp / "tokenizer.json"))

    atomic_dir(final, build, "tokenizer.json")
    return path


def byte_vocab(vocab_size: int) -> dict[str, int]:
    """Special tokens, the 256 byte-level symbols, then placeholders up to ``vocab_size``."""
    from tokenizers import pre_tokenizers

    if vocab_size < len(BYTE_SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab must be >= {len(BYTE_SPECIAL_TOKENS) + 256}, got {vocab_size}")
    vocab = {t: i for i, t in enumerate(BYTE_SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    i = 0
    while len(vocab) < vocab_size:  # plain ASCII letters/digits decode to themselves
        vocab.setdefault(f"tok{i}", len(vocab))
        i += 1
    return vocab


def write_byte_tokenizer(out: Path, vocab_size: int, max_pos: int) -> None:
    """``tokenizer.json`` (byte-level BPE, no merges) + ``tokenizer_config.json`` in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=byte_vocab(vocab_size), merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", model_max_length=max_pos, clean_up_tokenization_spaces=False), indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"), indent=2))


def save_tokenizer(model_dir: Path, tok_path: Path, max_pos: int) -> None:
    """Write the trained tokenizer (``tok_path``) into ``model_dir`` with the chat template."""
    from transformers import PreTrainedTokenizerFast

    ftok = PreTrainedTokenizerFast(
        tokenizer_file=str(tok_path), unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", model_max_length=max_pos)
    ftok.chat_template = CHAT_TEMPLATE
    ftok.save_pretrained(str(model_dir))
    # transformers 5 writes "TokenizersBackend"; this name loads in 4.x and 5.x alike
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
