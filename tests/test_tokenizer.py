"""Tokenizer: encode/decode and chat templates equal transformers' (the oracle) on the default model's tokenizer."""

from __future__ import annotations

import json
import os

import pytest
from tokenizer_fixture import sentencepiece_like_json, smollm2_tokenizer_dir
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from folio.loader.model_loader import eos_token_ids
from folio.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))  # 3",
    "Emoji: 🎉🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "日本語のテキストと中文文本，한국어 텍스트",
    "Café naïve résumé Ωμέγα Привет",
    "0123456789 3.14159 1,000,000 2024-01-31",
    "  leading and   runs    of spaces\t\ttabs\n\n\nnewlines  ",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "",
    " ",
    "a" * 300,
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi, how can I help?"},
     {"role": "user", "content": "Tell me a joke 😀 in 日本語."}],
]


@pytest.fixture(scope="session")
def smol_dir() -> str:
    return smollm2_tokenizer_dir()


@pytest.fixture(scope="session")
def tok(smol_dir) -> Tokenizer:
    return Tokenizer.from_dir(smol_dir)


@pytest.fixture(scope="session")
def hf_tok(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def _write(folder, tokenizer_json: str, config: dict, **files: str) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(tokenizer_json)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return str(folder)


def test_special_ids_match_transformers(tok, hf_tok):
    assert tok.vocab_size == len(hf_tok)
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.eos_token_id == hf_tok.eos_token_id == tok.backend.token_to_id("<|im_end|>")
    assert set(hf_tok.all_special_ids) <= tok.all_special_ids
    # all_special_ids are exactly what decode(skip_special_tokens=True) drops
    assert all(tok.decode([i]) == "" for i in tok.all_special_ids)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_transformers(tok, hf_tok, add_special_tokens):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf_tok.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip), text
    assert tok.decode(tok.encode(TEXTS[4])) == TEXTS[4]


def test_decode_token(tok, hf_tok):
    ids = tok.encode(" café 🎉 <|im_end|>")
    pieces = [tok.decode_token(i) for i in ids]
    assert pieces == [hf_tok.decode([i], skip_special_tokens=False) for i in ids]
    assert " café" in pieces and "<|im_end|>" in pieces
    assert "\ufffd" in pieces  # a byte of the emoji alone is not a character; still no error


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, hf_tok, conversation, add_generation_prompt):
    text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = hf_tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == expected
    ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    expected_ids = hf_tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, return_dict=False)
    assert ids == list(expected_ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("last", ["Sure, here is", "  The answer:  ", "ends with a newline\n"])
def test_continue_final_message_matches_transformers(tok, hf_tok, last):
    """The text ends inside the last (assistant) message, its edges as Transformers keeps them; refused with a
    generation prompt, and where the template does not show the content."""
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": last}]
    text = tok.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True)
    assert text == hf_tok.apply_chat_template(conversation, add_generation_prompt=False,
                                              continue_final_message=True, tokenize=False)
    assert text.endswith(last.rstrip()) or text.endswith(last)
    with pytest.raises(ValueError, match="cannot both be true"):
        tok.apply_chat_template(conversation, continue_final_message=True)
    hiding = "{% for m in messages %}[{{ m.role }}]{% endfor %}"
    with pytest.raises(ValueError, match="does not appear"):
        tok.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True,
                                chat_template=hiding)


def test_a_chat_template_of_the_callers_replaces_the_models(tok):
    conversation = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    assert tok.apply_chat_template(conversation, chat_template="{% for m in messages %}<{{ m.content }}>"
                                                                "{% endfor %}") == "<a>"
    assert tok.apply_chat_template(conversation, chat_template="{% for m in messages %}{% for p in m.content %}"
                                                                "({{ p.text }}){% endfor %}{% endfor %}") == "(a)"
    with pytest.raises(ValueError, match="does not compile"):
        tok.apply_chat_template(conversation, chat_template="{% for %}")
    assert tok.apply_chat_template(conversation).startswith("<|im_start|>system")  # the model's own is kept


def test_content_parts_join_for_string_templates(tok, hf_tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    joined = [{"role": "user", "content": "first\nsecond"}]
    assert tok.apply_chat_template(parts) == hf_tok.apply_chat_template(joined, add_generation_prompt=True,
                                                                         tokenize=False)
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_template_features(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'boom' %}{{ raise_exception('no boom') }}"
                "{% endif %}[{{ m.role }}]{% for p in m.content %}{{ p.text }}|{% endfor %}{% endfor %}"
                "{% if tools %}{{ tools | tojson }}{% endif %}{{ strftime_now('%Y')[:2] }}{{ custom }}")
    folder = _write(tmp_path, sentencepiece_like_json(), {"bos_token": "<s>", "eos_token": "</s>"},
                    **{"chat_template.jinja": template})
    tok = Tokenizer.from_dir(folder)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
              "name": None}]
    # a template that loops over content gets the parts; tojson keeps non-ASCII; kwargs become variables
    text = tok.apply_chat_template(parts, tools=[{"name": "café"}], custom="!")
    assert text == '<s>[user]a|b|[{"name": "café"}]20!'
    assert tok.apply_chat_template(parts, tokenize=True)[0] == tok.bos_token_id
    with pytest.raises(ValueError, match="no boom"):
        tok.apply_chat_template([{"role": "boom", "content": []}])


def test_template_sources_and_errors(tmp_path):
    sp = sentencepiece_like_json()
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages[0].content }}"}]
    tok = Tokenizer.from_dir(_write(tmp_path / "named", sp, {"chat_template": named}))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
    no_template = Tokenizer.from_parts(sp, {})
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
    broken = Tokenizer.from_parts(sp, {"chat_template": "{% for %}"})
    assert broken.encode("Hello") == [259]  # a broken template does not stop the tokenizer from loading
    with pytest.raises(ValueError, match="does not compile"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path / "missing"))


def test_eos_ids_join_generation_config_config_and_tokenizer(tmp_path):
    """A request ends at the tokenizer's EOS and at every id config.json and generation_config.json list
    (instruct models' end-of-turn ids); the model loader works them out, the tokenizer keeps its own."""
    tok = Tokenizer.from_dir(_write(tmp_path, sentencepiece_like_json(), {"bos_token": "<s>", "eos_token": "</s>"}))
    assert tok.eos_token_id == 2
    assert eos_token_ids({"eos_token_id": 9}, {"eos_token_id": [2, 7]}, tok) == {2, 7, 9}
    assert eos_token_ids({"eos_token_id": 9}, {}, Tokenizer.from_parts(sentencepiece_like_json(), {})) == {9}


def _with_bos_post_processor(tokenizer_json: str) -> str:
    backend = BackendTokenizer.from_str(tokenizer_json)
    backend.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", special_tokens=[("<s>", 1)])
    return backend.to_str()


@pytest.mark.parametrize("bos_post_processor,flags,expected", [
    (False, {}, [259, 260]),
    (False, {"add_bos_token": True}, [1, 259, 260]),
    (False, {"add_bos_token": True, "add_eos_token": True}, [1, 259, 260, 2]),
    (True, {}, [1, 259, 260]),  # Llama 3 style: tokenizer.json's own post-processor adds BOS
    (True, {"add_bos_token": False}, [259, 260]),  # an explicit config flag wins, as in LlamaTokenizerFast
])
def test_bos_follows_config(bos_post_processor, flags, expected):
    sp = sentencepiece_like_json()
    tok = Tokenizer.from_parts(_with_bos_post_processor(sp) if bos_post_processor else sp,
                               {"bos_token": "<s>", "eos_token": "</s>", **flags})
    assert tok.encode("Hello world") == expected
    assert tok.encode("Hello world", add_special_tokens=False) == [259, 260]
    assert tok.decode(expected) == "Hello world"
