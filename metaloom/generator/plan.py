"""From a `Request` to the rows the decode loop admits: encoding, validation and preparation,
all before any compute (a bad request is a typed error and costs nothing).

A `Plan` is one validated request: its prompt ids (prompt, then the answer-so-far prefix), its
compiled constraint (or healing), its decoder. `Plan.rows` makes the `NewRow`s of its samples.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from metaloom.constrain import Constraint
from metaloom.decode.healing import Prepared, prepare
from metaloom.decode.joining import NewRow
from metaloom.decode.specs import BeamParams, ContrastiveParams, GuidanceParams
from metaloom.errors import ContextWindowExceeded, InvalidParameter
from metaloom.generator.types import Prompt, Request, TokenIds
from metaloom.ledger import Ledger
from metaloom.sampling.counter import row_key

if TYPE_CHECKING:
    from metaloom.generator.local import LocalGenerator


@dataclass(frozen=True)
class Plan:
    """A validated request. ``ids``: what the model reads before the output, the last
    ``prefix`` of them the answer so far; ``negative``: guidance's unconditional prompt ids."""

    request: Request
    ids: tuple[int, ...]
    prefix: int
    prepared: Prepared | None
    negative: tuple[int, ...] | None = None

    @property
    def kind(self) -> type:
        return type(self.request.decoder)

    def cursor(self) -> Constraint | None:
        """A fresh constraint cursor for one sample, advanced through the prefix."""
        if self.prepared is None:
            return None
        cursor = self.prepared.cursor()
        if cursor is not None:
            for token in self.ids[len(self.ids) - self.prefix:]:
                cursor.advance(token)
        return cursor

    def rows(self, ledger: Ledger, device: torch.device, tag: Any = None) -> list[NewRow]:
        """The ``n`` rows of this request: one prefill, one RNG for the pipeline's coins and
        one random key per sample for its draws (`metaloom.sampling.counter`), from the request's
        seed or, when it has none, from the OS — never from torch's global generator."""
        p = self.request.params
        rng, seed = None, 0
        if not p.greedy:
            seed = p.seed if p.seed is not None else secrets.randbits(63)
            rng = torch.Generator(device=device)
            rng.manual_seed(seed)
        combine: tuple[float, ...] = ()
        decoder = self.request.decoder
        if isinstance(decoder, (ContrastiveParams, GuidanceParams)):
            combine = decoder.row()
        secondary = None
        if self.negative is not None:
            secondary = self.negative + self.ids[len(self.ids) - self.prefix:]
        group = ("request", id(self), tag)
        return [NewRow(prompt=self.ids, params=p, ledger=ledger, prefix=self.prefix, rng=rng, key=row_key(seed, i),
                       cursor=self.cursor(),
                       group=group, secondary=secondary, combine=combine, tag=(tag, i)) for i in range(p.n)]


def encode(engine: LocalGenerator, prompt: Prompt) -> list[int]:
    """A prompt's token ids: raw text encoded as the tokenizer does (special tokens added),
    chat messages through the chat template, `TokenIds` as given."""
    if isinstance(prompt, TokenIds):
        ids = list(prompt.ids)
    elif isinstance(prompt, str):
        ids = engine.tokenizer.encode(prompt)
    else:
        ids = engine.tokenizer.encode(engine.render(prompt), add_special_tokens=False)
    if not ids:
        raise InvalidParameter("prompt", prompt, "text that encodes to at least one token")
    return ids


def check_ids(name: str, ids: tuple[int, ...] | list[int], vocab: int) -> None:
    """Raise `InvalidParameter` for token ids outside the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidParameter(name, bad[:8], f"token ids in [0, {vocab})")


def plan(engine: LocalGenerator, request: Request) -> Plan:
    """Validate ``request`` against ``engine`` and prepare it (see the module docstring)."""
    engine.capabilities.check(request, engine.name)
    model, vocab = engine.model, engine.model.vocab_size
    ids = encode(engine, request.prompt)
    # given ids, or a tokenizer whose ids the model does not have (a mismatched pair): a typed
    # error naming the prompt, never an index error deep in the first forward
    check_ids("prompt ids", ids, vocab)
    check_ids("prefix", request.prefix, vocab)
    prepared = None
    if request.constraint is not None or request.token_healing:
        # token healing and grammar compilation (a bad grammar raises here, before any compute)
        prepared = prepare(ids, request.constraint, request.token_healing, engine.vocabulary)
        ids = list(prepared.ids)
    full = tuple(ids) + request.prefix
    p = request.params
    window = model.max_context
    if len(full) >= window:
        raise ContextWindowExceeded(len(full), window, "prompt" + (" plus prefix" if request.prefix else ""))
    if len(full) + p.max_tokens > window:
        raise ContextWindowExceeded(len(full) + p.max_tokens, window, f"prompt ({len(full)} tokens) plus max_tokens")
    p.check_vocab(vocab)
    out = Plan(request, full, len(request.prefix), prepared)
    if prepared is not None and request.prefix:
        try:
            out.cursor()  # the prefix must be something the constraint allows
        except InvalidParameter as exc:
            raise InvalidParameter("prefix", list(request.prefix)[:16], "tokens the constraint allows from its start") from exc
    decoder = request.decoder
    if isinstance(decoder, BeamParams):
        decoder.check_sampling(p)
    if isinstance(decoder, ContrastiveParams):
        amateur = engine.amateur
        assert amateur is not None  # capabilities say contrastive only with an amateur
        if len(full) + p.max_tokens > amateur.max_context:
            raise ContextWindowExceeded(len(full) + p.max_tokens, amateur.max_context, "prompt plus max_tokens (amateur model)")
    if isinstance(decoder, GuidanceParams):
        negative = tuple(encode(engine, decoder.negative_prompt)) if decoder.negative_prompt is not None else tuple(ids[-1:])
        if len(negative) + len(request.prefix) + p.max_tokens > window:
            raise ContextWindowExceeded(len(negative) + len(request.prefix) + p.max_tokens, window,
                                        "negative prompt plus max_tokens")
        out = Plan(request, full, len(request.prefix), prepared, negative)
    return out
