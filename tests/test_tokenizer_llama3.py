"""Tokenizer vs transformers (the oracle) on the real LLaMA-3 tokenizer files."""

from __future__ import annotations

import json
import shutil

import pytest
from assets import asset

from bitnetlm.generate import Tokenizer

TEXTS = [
    "Hello world",
    "",
    " leading space and trailing  ",
    "The capital of France is Paris. It's 2024!\n\nNew paragraph\ttab",
    "emoji 🦙🔥 and CJK 日本語のテキスト, 中文 ñandú",
    "special token in text <|eot_id|> and <|begin_of_text|>",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "numbers 1234567 3.14159 -0.5e10",
]

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a llama 🦙"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "日本語で話して"},
    ],
]


@pytest.fixture(scope="module")
def tok_dir():
    return asset("llama3-tokenizer")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def test_hello_world_with_bos_from_post_processor(tok):
    assert tok.encode("Hello world") == [128000, 9906, 1917]
    assert tok.encode("Hello world", add_special_tokens=False) == [9906, 1917]
    assert tok.bos_token_id == 128000
    assert tok.vocab_size == 128256
    assert tok.token_to_id("<|eot_id|>") == 128009
    assert 128009 in tok.eos_token_ids


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf, text):
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == hf(text, add_special_tokens=special).input_ids
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_matches_transformers(tok, hf, chat, gen):
    ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
    theirs = hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
    assert ours == theirs
    ids = tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True)
    assert ids == hf(theirs, add_special_tokens=False).input_ids
    assert ids[0] == 128000 and ids.count(128000) == 1  # BOS from the template only, never doubled


def test_template_globals_like_transformers(tok, hf):
    # raise_exception, strftime_now, tojson (no HTML escaping), special-token variables, loop controls
    tpl = (
        "{% if messages|length == 0 %}{{ raise_exception('empty') }}{% endif %}"
        "{{ bos_token }}[{{ eos_token }}]{{ messages|tojson }}{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index0 > 0 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    )
    msgs = [{"role": "user", "content": "<a & b>"}, {"role": "assistant", "content": "x", "tool_calls": None}]
    ours = tok.apply_chat_template(msgs, chat_template=tpl)
    theirs = hf.apply_chat_template(msgs, chat_template=tpl, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"<a & b>"' in ours and "tool_calls" not in ours
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="empty"):
        tok.apply_chat_template([], chat_template=tpl)


def test_sandbox_blocks_attribute_escape(tok):
    import jinja2

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=evil)


def test_eos_ids_from_generation_and_model_config(tok_dir, tmp_path):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, tmp_path / f)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 128008}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids == [128009, 128001, 128008]
    assert t.eos_token_id == 128009


def test_save_roundtrip_and_from_tokenizers(tok, tmp_path):
    tok.save(tmp_path)
    t2 = Tokenizer.from_dir(tmp_path)
    assert t2.encode(TEXTS[4]) == tok.encode(TEXTS[4])
    assert t2.apply_chat_template(CHATS[2]) == tok.apply_chat_template(CHATS[2])
    t3 = Tokenizer.from_tokenizers(
        tok.backend, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "eos_token_ids": [128001]}
    )
    assert t3.eos_token_ids == [128009, 128001]
    assert t3.encode("Hello world") == [128000, 9906, 1917]
    with pytest.raises(ValueError, match="no chat_template"):
        t3.apply_chat_template(CHATS[0])


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
