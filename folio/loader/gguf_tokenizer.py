"""Rebuild a `tokenizers` tokenizer from a GGUF file's metadata: a GGUF stores vocabulary, merges (or
SentencePiece scores) and token types, not a tokenizer.json, so one is made here that splits text the way
llama.cpp does for the file's `tokenizer.ggml.pre`."""

from __future__ import annotations

import logging
from typing import Callable, Optional

from gguf import GGUFReader, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from folio.loader.gguf_metadata import get_field as _get

logger = logging.getLogger(__name__)


def build_tokenizer(reader: GGUFReader, model: Optional[str], tokens: list[str], special: dict[str, Optional[int]],
                    add_bos: bool, add_eos: bool) -> Tokenizer:
    """The whole tokenizer: model, pre-tokenizer, decoder, special tokens and the BOS/EOS post-processor."""
    tokenizer = _build_tokenizer(reader, model, tokens)
    _add_special_tokens(tokenizer, reader, model, tokens, special)
    tokenizer.post_processor = _post_processor(tokens, special, add_bos, add_eos)
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level BPE vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS.values())

# The split regexes llama.cpp applies per `tokenizer.ggml.pre` (llama-vocab.cpp), as `tokenizers` pre-tokenizers.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek V3's (llama.cpp's DEEPSEEK3_LLM): digits in threes, then CJK runs, then the rest; each expression splits
# the pieces the one before left
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek LLM's and V2's (llama.cpp's DEEPSEEK_LLM): line breaks, runs of cased letters (its table of scripts with
# case, the Deseret range written as its characters), of ASCII and full-width punctuation, trailing spaces, CJK, digits
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    r"\s?["
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁ"
    "Ҋ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝ"
    "Ὗ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴ"
    "ῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮ"
    "ⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟"
    "𞤀-𞥃" "]+",  # (escaped: characters NFC would turn into others)
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
# DeepSeek Coder's (llama.cpp's DEEPSEEK_CODER)
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")


def _regex_then_bytes(*regexes: str) -> pre_tokenizers.PreTokenizer:
    """Split by each expression in turn (each splits the pieces the one before left, matches and the text between
    them alike, as llama.cpp's unicode_regex_split does), then map bytes to GPT-2's characters."""
    return pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # Every digit on its own, then GPT-2's regex: llama.cpp's "\p{N}" + gpt2 expressions, and SmolLM's tokenizer.json.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre -> pre-tokenizer, grouped as llama.cpp's llama-vocab.cpp groups them. Unknown names get
# GPT-2's regex (with a warning), as in transformers.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    **dict.fromkeys(["default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo"], _gpt2),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    _digits_then_gpt2),
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "lfm2", "dbrx", "smaug-bpe"],
                    lambda: _regex_then_bytes(_LLAMA3_SPLIT)),
    **dict.fromkeys(["glm4", "chatglm-bpe"], lambda: _regex_then_bytes(_LLAMA3_SPLIT)),  # llama.cpp's CHATGLM4
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"],
                    lambda: _regex_then_bytes(_QWEN2_SPLIT)),
    "deepseek-llm": lambda: _regex_then_bytes(*_DEEPSEEK_LLM_SPLITS),
    "deepseek-v3": lambda: _regex_then_bytes(*_DEEPSEEK_V3_SPLITS),
    "deepseek-coder": lambda: _regex_then_bytes(*_DEEPSEEK_CODER_SPLITS),
}
# Llama-3's tokenizer looks a whole pre-token up in the vocabulary before merging (llama.cpp's ignore_merges).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "lfm2"})


def _build_tokenizer(reader: GGUFReader, model: Optional[str], tokens: list[str]) -> Tokenizer:
    if model == "gpt2":
        return _byte_level_bpe(reader, tokens)
    if model == "llama":
        return _sentencepiece_bpe(reader, tokens)
    raise ValueError(
        f"unsupported GGUF tokenizer model {model!r}; "
        "folio supports 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
    )


def _byte_level_bpe(reader: GGUFReader, tokens: list[str]) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) from the vocabulary and merges, split as tokenizer.ggml.pre says."""
    # Tokens the file stores as raw text rather than in the byte alphabet get respelled, as transformers does.
    vocab = {
        t if set(t) <= _BYTE_ALPHABET else "".join(_BYTE_CHARS[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in _get(reader, "tokenizer.ggml.merges", [])]
    pre = _get(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        logger.warning("unknown GGUF pre-tokenizer %r: splitting text with GPT-2's regex", pre)
    bpe = models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS.get(pre, _gpt2)()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(reader: GGUFReader, tokens: list[str]) -> Tokenizer:
    """SentencePiece BPE as byte-fallback BPE, with merges recovered from the token scores (as transformers does)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = _get(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk = _get(reader, "tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab, _merges_from_scores(vocab, dict(zip(tokens, scores))),
        unk_token=None if unk is None else tokens[unk], fuse_unk=True, byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    add_space = bool(_get(reader, "tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space else []))
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary pieces, best-scored token first.

    The same order as transformers' `generate_merges`, so both tokenizers merge identically.
    """
    merges = []
    for token, score in scores.items():
        splits = ((token[:i], token[i:]) for i in range(1, len(token)))
        pairs = [(left, right, score) for left, right in splits if left in vocab and right in vocab]
        merges.extend(sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    merges.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(
    tokenizer: Tokenizer, reader: GGUFReader, model: Optional[str], tokens: list[str], special: dict[str, Optional[int]]
) -> None:
    """Make control tokens (and bos/eos/unk/pad) whole special tokens, and user-defined ones whole added tokens.

    Otherwise `<|im_start|>` in a chat prompt would be cut into `<`, `|`, `im`... In a byte-level
    vocabulary a control token spelled outside the byte alphabet is a mislabel and is skipped, as in
    transformers: adding it would create a new id beyond the model's vocabulary.
    """
    types = _get(reader, "tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    spelled = (lambda t: set(t) <= _BYTE_ALPHABET) if model == "gpt2" else (lambda t: True)
    special_ids = {i for i, kind in enumerate(types) if kind == TokenType.CONTROL} | {
        i for i in special.values() if i is not None
    }
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special_ids) if spelled(tokens[i])]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for i, (t, kind) in enumerate(zip(tokens, types))
            if kind == TokenType.USER_DEFINED and i not in special_ids and spelled(t)
        ]
    )


def _post_processor(
    tokens: list[str], special: dict[str, Optional[int]], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """Add BOS/EOS when encoding exactly as the file asks, like a Hugging Face tokenizer.json does."""
    bos = [special["bos"]] if add_bos and special["bos"] is not None else []
    eos = [special["eos"]] if add_eos and special["eos"] is not None else []
    single = " ".join([*(tokens[i] for i in bos), "$A", *(tokens[i] for i in eos)])
    return processors.TemplateProcessing(
        single=single,
        pair=f"{single} {single.replace('$A', '$B:1')}",
        special_tokens=[(tokens[i], i) for i in dict.fromkeys(bos + eos)],
    )
