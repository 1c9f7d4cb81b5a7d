"""Tokenizer: a `tokenizers.Tokenizer` plus what transformers reads from the model directory.

- tokenizer.json          -> the `tokenizers` object; its post-processor adds special tokens (BOS) exactly as
                             transformers' fast tokenizers do, because both call the same Rust code.
- tokenizer_config.json   -> special-token strings, the chat template (rendered with a sandboxed jinja2
                             environment that offers the same globals and filters as transformers).
- generation_config.json, config.json -> extra end-of-sequence ids (LLaMA-3 chat models stop on <|eot_id|>
                             as well as <|end_of_text|>).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _token_str(v: Any) -> str | None:
    # tokenizer_config stores special tokens either as strings or as serialized AddedToken dicts
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


def _as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]


def _plain(value: Any) -> Any:
    """Plain JSON data for the template (as transformers does): dataclasses/pydantic -> dicts, drop None keys."""
    import dataclasses

    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def _compile_template(source: str):
    """A template in the environment transformers uses (ImmutableSandboxedEnvironment, trim/lstrip blocks)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers overrides it with plain json.dumps
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class _Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; render it as-is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """Encode/decode text and render chat templates for one model.

    Build with `Tokenizer.from_dir(model_dir)` or `Tokenizer.from_tokenizers(tokenizers_obj, config_dict)`.
    """

    def __init__(self, backend, config: dict | None = None, eos_token_ids=None, source: str = "<memory>"):
        self.backend = backend  # tokenizers.Tokenizer
        # a tokenizer.json may carry fixed padding / truncation (BERT files: 128); transformers ignores both
        # unless a call asks for them, and so do we
        backend.no_padding()
        backend.no_truncation()
        self.config = dict(config or {})
        self.source = source
        self._special: dict[str, str] = {}
        for name in SPECIAL_NAMES:
            s = _token_str(self.config.get(name))
            if s is not None:
                self._special[name] = s
        self.chat_template = self._pick_template(self.config.get("chat_template"))
        # every added token flagged special (skipped by decode(skip_special_tokens=True))
        self.all_special_ids = sorted(
            int(i) for i, t in backend.get_added_tokens_decoder().items() if getattr(t, "special", False)
        )
        ids: list[int] = []
        eos = self._special.get("eos_token")
        eos_id = backend.token_to_id(eos) if eos is not None else None  # (get_vocab builds a 128k-entry dict)
        if eos_id is not None:
            ids.append(eos_id)
        for i in _as_id_list(eos_token_ids):
            if i not in ids:
                ids.append(i)
        self.eos_token_ids = ids
        model_type = type(backend.model).__name__
        clean = bool(self.config.get("clean_up_tokenization_spaces", False))
        # transformers skips this cleanup for BPE models: it would strip real spaces before punctuation
        force = bool(
            self.config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        )
        self.clean_up_tokenization_spaces = clean and (model_type != "BPE" or force)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        from tokenizers import Tokenizer as _Tok

        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(
                f"{tj}: no tokenizer.json in {path!r} (bitnet-lm needs the fast-tokenizer file written by "
                "transformers' save_pretrained)"
            )
        try:
            backend = _Tok.from_file(tj)
        except Exception as e:  # the Rust error names no file
            raise ValueError(f"{tj}: cannot be read by the tokenizers library: {e}") from e
        cfg_path = os.path.join(path, "tokenizer_config.json")
        config = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        jinja_path = os.path.join(path, "chat_template.jinja")
        if "chat_template" not in config and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                config["chat_template"] = f.read()
        ct_json = os.path.join(path, "chat_template.json")
        if "chat_template" not in config and os.path.isfile(ct_json):
            config["chat_template"] = _read_json(ct_json).get("chat_template")
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            p = os.path.join(path, name)
            if os.path.isfile(p):
                for i in _as_id_list(_read_json(p).get("eos_token_id")):
                    if i not in eos:
                        eos.append(i)
        return cls(backend, config, eos_token_ids=eos, source=path)

    @classmethod
    def from_tokenizers(cls, obj, config: dict | None = None) -> Tokenizer:
        """Wrap an existing `tokenizers.Tokenizer` (e.g. one rebuilt from GGUF metadata).

        `config` is a tokenizer_config-style dict (bos_token, eos_token, chat_template, ...) and may also
        carry "eos_token_ids" (a list of extra stop ids).
        """
        config = dict(config or {})
        extra = config.pop("eos_token_ids", None)
        return cls(obj, config, eos_token_ids=extra)

    @staticmethod
    def _pick_template(t):
        # tokenizer_config may hold a list of named templates; "default" is what transformers uses
        if isinstance(t, list):
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            return named.get("default") or next(iter(named.values()), None)
        return t

    # ---- special tokens ------------------------------------------------------------------
    def _id(self, name: str) -> int | None:
        s = self._special.get(name)
        return None if s is None else self.backend.token_to_id(s)

    @property
    def bos_token(self) -> str | None:
        return self._special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        i = self._id("eos_token")
        return i if i is not None else (self.eos_token_ids[0] if self.eos_token_ids else None)

    @property
    def pad_token_id(self) -> int | None:
        i = self._id("pad_token")
        return i if i is not None else self.eos_token_id

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    # ---- encode / decode -----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(
        self,
        ids,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        clean = (
            self.clean_up_tokenization_spaces
            if clean_up_tokenization_spaces is None
            else clean_up_tokenization_spaces
        )
        return _clean_up_tokenization(text) if clean else text

    # ---- chat template -------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list | None = None,
        documents: list | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs,
    ):
        """Render `messages` ([{"role", "content"}, ...]) like transformers' apply_chat_template.

        tokenize=True returns ids encoded without adding special tokens (the template writes BOS itself).
        """
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                f"{self.source}: the tokenizer has no chat_template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); pass chat_template=... or use a plain text prompt"
            )
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"apply_chat_template expects a list of messages, got {type(messages).__name__}")
        chat = []
        for m in _plain(list(messages)):
            if not isinstance(m, dict):
                raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {m!r}")
            # APIs send content=None / tool_calls=None; templates handle a missing key better than None
            chat.append({k: v for k, v in m.items() if v is not None})
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        if continue_final_message:
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise ValueError("continue_final_message needs a final message with string content")
            chat[-1]["content"] = chat[-1]["content"] + tag
        context = {**self._special, **_plain(kwargs)}  # kwargs override special tokens, as in transformers
        text = _compile_template(template).render(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **context,
        )
        if continue_final_message:
            loc = text.rindex(tag.strip())
            text = text[:loc] if text[loc : loc + len(tag)] == tag else text[:loc].rstrip()
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json into directory `path` (temp file + rename)."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        tj = os.path.join(path, "tokenizer.json")
        self.backend.save(tj + ".tmp")
        os.replace(tj + ".tmp", tj)
        cfg = dict(self.config)
        cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        tc = os.path.join(path, "tokenizer_config.json")
        with open(tc + ".tmp", "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)
        os.replace(tc + ".tmp", tc)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos_token_ids={self.eos_token_ids}, chat_template={'yes' if self.chat_template else 'no'})"
        )


def _clean_up_tokenization(s: str) -> str:
    # transformers' PreTrainedTokenizerBase.clean_up_tokenization (for WordPiece-style vocabularies)
    return (
        s.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )
