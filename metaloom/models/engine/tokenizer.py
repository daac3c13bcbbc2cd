"""Tokenizer from a transformers tokenizer folder (``tokenizer.json`` + ``tokenizer_config.json``
/ ``chat_template.jinja``), on the `tokenizers` library and Jinja2 directly: importing
transformers would add seconds to every CLI start. The chat template is the model's own (the
folder's, or the GGUF's, which the conversion writes there), rendered as transformers'
``apply_chat_template`` renders it; a model without one says so once (a warning) and its chat
prompts run raw: the messages' text as it is."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from metaloom.errors import InvalidParameter, NotAModel

log = logging.getLogger(__name__)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer:
    def __init__(self, folder: str, extra_eos_ids: Sequence[int] = (),
                 template_args: Mapping[str, Any] | None = None) -> None:
        """``template_args``: extra variables the chat template reads (Qwen3's ``enable_thinking``)."""
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
        self.template_args = dict(template_args or {})
        self._folder = folder
        self._warned = False

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

    def _adds_bos(self) -> bool:
        """Whether encoding plain text adds the BOS token (chat prompts are encoded without)."""
        bos = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        return bos is not None and bos in self._tok.encode("a", add_special_tokens=True).ids[:1]

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """``messages`` through the chat template; ``tools``: the functions the model may call,
        in OpenAI's shape, for a template that renders them (`metaloom.server.tools`)."""
        if self.chat_template is None:
            if not self._warned:
                log.warning("%s has no chat template: chat prompts run raw (the messages' text as it is)", self._folder)
                self._warned = True
            # raw, as a plain prompt would be encoded: with the BOS the tokenizer adds to plain text
            bos = self.bos_token if self.bos_token and self._adds_bos() else ""
            return bos + "\n\n".join(_text(m.get("content")) for m in messages)
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
        extra = self.template_args | ({"tools": list(tools)} if tools else {})
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
