"""Tokenizer from a transformers tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json``
/ ``chat_template.jinja``), on the `tokenizers` library and Jinja2 directly: importing
transformers would add seconds to every CLI start."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from metaloom.errors import InvalidParameter, NotAModel


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer:
    def __init__(self, folder: str, extra_eos_ids: Sequence[int] = ()) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        path = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(path):
            raise NotAModel(f"{folder} has no tokenizer.json")
        self._tok = RustTokenizer.from_file(path)
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        eos = set(extra_eos_ids)
        if self.eos_token is not None and (i := self._tok.token_to_id(self.eos_token)) is not None:
            eos.add(i)
        self._eos = frozenset(eos)
        self._template: Any = None  # compiled on first use

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """``messages`` through the chat template; ``tools``: the functions the model may call,
        in OpenAI's shape, for a template that renders them (`metaloom.server.tools`)."""
        if self.chat_template is None:
            raise InvalidParameter("chat", True, "raw prompts only: this tokenizer has no chat template")
        if self._template is None:
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise InvalidParameter("messages", message, "what the chat template accepts")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        extra = {"tools": list(tools)} if tools else {}
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
