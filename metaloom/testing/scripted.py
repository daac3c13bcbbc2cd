"""A scripted `Generator` and scripted scorers: golden tables for strategies, in microseconds.

`ScriptedGenerator` plays a table ``prompt -> responses``. Text is tokenised into words
(each token is a run of whitespace plus a run of non-whitespace, so joining tokens gives the
text back). It charges the ledger the way the local engine does, step by step:

- ``input_tokens``: the prompt's tokens, once per request (a request with ``n`` samples is
  prefilled once and forked);
- one forward pass for the batched prefill, then one per decode step while any row of the
  call is unfinished (a call whose longest row has L tokens costs L forward passes);
- ``output_tokens``: every generated token, the end-of-sequence token included (it is
  emitted when a response runs out before ``max_tokens``; a stop string ends the row at the
  token that completes it, whose text is cut, as in `metaloom.decode.rows`).

FLOPs and seconds are not modelled (charged 0), so golden figures are exact. Sampling
parameters other than ``n``, ``max_tokens``, ``stop`` and ``include_stop_str_in_output``
(temperature, logit bias, seeds) do not change what is played; constraints, token healing
and decoders other than the pipeline are refused with `Unsupported` (its `capabilities` say
so). A budget reached mid-call ends the unfinished rows with finish "budget", as the engine does.

Token ids: each word gets an id (crc32), and the generator remembers the word behind every id
it produced, so `TokenIds` prompts and `Request.prefix` (exact continuation) work with ids it
handed out. `score` gives each token of a continuation the log-probability of the scripted
response it belongs to (``likelihoods`` overrides by continuation text).

Lookup: a raw prompt is matched against the table keys; a chat prompt is its last user
message (the scripted "chat template" renders a conversation as that message, so ``render``
is consistent with lookup). An exact key yields the key's next ``n`` responses, cycling. A
prompt that extends a key continues one of its responses: the one that produced that text
(remembered), else the first response that starts with it — this is what a model asked to
continue its own partial output does, and what chunked strategies rely on. The longest
matching key wins, so a table can also script what follows an inserted "Wait".
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from metaloom.errors import BudgetExceeded, InvalidParameter
from metaloom.generator.capabilities import SAMPLING_FIELDS, Capabilities
from metaloom.generator.types import Completion, Message, Request, Scored, StreamChunk, TokenIds
from metaloom.generator.types import Prompt as AnyPrompt
from metaloom.ledger import Ledger
from metaloom.score.prompting import user_text
from metaloom.score.protocols import Prompt

CAPABILITIES = Capabilities(sampling=SAMPLING_FIELDS - {"top_logprobs"}, decoders=frozenset(), constraints=frozenset(),
                            features=frozenset({"token_ids", "logprobs", "score", "render", "stream", "token_prompts",
                                                "prefix"}))
UNKNOWN_LOGPROB = -10.0  # per token of a continuation no scripted response contains

EOS_ID = 0
_TOKEN = re.compile(r"\s*\S+|\s+$")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def count_tokens(text: str) -> int:
    return len(tokens(text))


@dataclass(frozen=True)
class Say:
    """One scripted response; every token of it (and its end-of-sequence) has log-probability
    ``logprob``."""

    text: str
    logprob: float = -1.0


def word_id(word: str) -> int:
    return zlib.crc32(word.encode()) % 50_000 + 1


@dataclass
class _Row:
    say: Say
    words: list[str]  # tokens still to emit
    max_tokens: int
    stop: tuple[str, ...]
    include_stop: bool = False
    text: str = ""
    ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish: str | None = None
    stop_reason: str | int | None = None
    key: str = ""  # table key and response index this row plays, and the text before it
    index: int = 0
    prefix: str = ""
    last_word: str = ""  # the word behind the last id

    def step(self) -> str:
        """Emit one token; returns the new visible text."""
        before = len(self.text)
        if not self.words:
            self.ids, self.logprobs = (*self.ids, EOS_ID), (*self.logprobs, self.say.logprob)
            self.finish, self.stop_reason, self.last_word = "stop", EOS_ID, ""
            return ""
        word = self.last_word = self.words.pop(0)
        self.ids = (*self.ids, word_id(word))
        self.logprobs = (*self.logprobs, self.say.logprob)
        self.text += word
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, before - len(s)))) >= 0]
        if hits:
            at, matched = min(hits)
            if not self.include_stop:
                self.text = self.text[:at]
            self.finish, self.stop_reason = "stop", matched
        elif len(self.ids) >= self.max_tokens:
            self.finish = "length"
        return self.text[before:]

    def completion(self) -> Completion:
        assert self.finish is not None
        return Completion(self.text, self.ids, self.logprobs, self.finish, self.stop_reason)


class ScriptedGenerator:
    """Implements `Generator` from ``table``: prompt -> responses (str or `Say`). ``requests``
    records every request it served, for assertions. ``likelihoods``: continuation text ->
    per-token log-probability for `score` (default: that of the scripted response the
    continuation starts, else `UNKNOWN_LOGPROB`)."""

    capabilities = CAPABILITIES

    def __init__(self, table: Mapping[str, Sequence[str | Say]], likelihoods: Mapping[str, float] | None = None) -> None:
        self.table = {k: [Say(r) if isinstance(r, str) else r for r in v] for k, v in table.items()}
        self.likelihoods = dict(likelihoods or {})
        self.cursor = dict.fromkeys(self.table, 0)
        self.produced: dict[tuple[str, str], int] = {}  # (key, text so far) -> response index
        self.words: dict[int, str] = {EOS_ID: ""}  # every id handed out -> its word
        self.requests: list[Request] = []

    def render(self, prompt: AnyPrompt | Sequence[Message]) -> str:
        if isinstance(prompt, TokenIds):
            return self._text(prompt.ids, "prompt ids")
        return user_text(prompt if isinstance(prompt, str) else tuple(prompt))

    def _text(self, ids: Sequence[int], name: str) -> str:
        unknown = [t for t in ids if t not in self.words]
        if unknown:
            raise InvalidParameter(name, unknown[:8], "ids this scripted generator produced")
        return "".join(self.words[t] for t in ids)

    def _lookup(self, text: str, n: int) -> list[tuple[str, int, str]]:
        """(key, response index, text still to emit) for each of ``n`` samples."""
        keys = [k for k in self.table if text.startswith(k)]
        if not keys:
            raise LookupError(f"scripted generator has no entry for prompt {text!r}")
        key = max(keys, key=len)
        rest, responses = text[len(key):], self.table[key]
        if not rest:
            picked = []
            for _ in range(n):
                picked.append(self.cursor[key] % len(responses))
                self.cursor[key] += 1
            return [(key, i, responses[i].text) for i in picked]
        i = self.produced.get((key, rest))
        if i is None:
            i = next((j for j, r in enumerate(responses) if r.text.startswith(rest)), None)
        if i is None:
            raise LookupError(f"scripted generator cannot continue {text!r}: no response of {key!r} starts with {rest!r}")
        return [(key, i, responses[i].text[len(rest):])] * n

    def _rows(self, request: Request) -> list[_Row]:
        self.capabilities.check(request, type(self).__name__)
        text, p = self.render(request.prompt) + self._text(request.prefix, "prefix"), request.params
        return [_Row(self.table[key][i], tokens(remaining), p.max_tokens, p.stop, p.include_stop_str_in_output, key=key,
                     index=i, prefix=text[len(key):]) for key, i, remaining in self._lookup(text, p.n)]

    def _steps(self, requests: Sequence[Request], rows: Sequence[Sequence[_Row]],
               ledger: Ledger) -> Iterator[list[tuple[_Row, str]]]:
        self.requests.extend(requests)
        flat = [row for rs in rows for row in rs]
        try:
            ledger.charge(input_tokens=sum(max(1, count_tokens(self.render(r.prompt))) + len(r.prefix) for r in requests))
            ledger.charge(forward_passes=1)  # batched prefill
            while True:
                stepped = [(row, row.step()) for row in flat if row.finish is None]
                for row, _ in stepped:
                    self.words[row.ids[-1]] = row.last_word
                try:
                    ledger.charge(output_tokens=len(stepped))
                finally:
                    yield stepped
                if all(row.finish is not None for row in flat):
                    break
                ledger.charge(forward_passes=1)
        except BudgetExceeded:  # recorded; what the rows have so far comes back, as from the engine
            for row in flat:
                if row.finish is None:
                    row.finish = "budget"
            yield [(row, "") for row in flat if row.finish == "budget"]
        for row in flat:  # so a continuation of this text resumes this response
            self.produced[(row.key, row.prefix + row.text)] = row.index

    def generate(self, requests: Sequence[Request], *, ledger: Ledger) -> list[list[Completion]]:
        if not requests:
            return []
        rows = [self._rows(r) for r in requests]  # every lookup before any charge, like the engine's validation
        for _ in self._steps(requests, rows, ledger):
            pass
        return [[row.completion() for row in rs] for rs in rows]

    def stream(self, request: Request, *, ledger: Ledger) -> Iterator[StreamChunk]:
        rows = self._rows(request)
        index = {id(row): i for i, row in enumerate(rows)}
        for stepped in self._steps([request], [rows], ledger):
            for row, text in stepped:
                yield StreamChunk(text, row.ids[-1:] if row.finish != "budget" else (), row.logprobs[-1:]
                                  if row.finish != "budget" else (), row.finish, row.stop_reason, index[id(row)])

    def score(self, prompt: AnyPrompt, continuations: Sequence[str | TokenIds], *, ledger: Ledger) -> list[Scored]:
        text = self.render(prompt)
        out = []
        for c in continuations:
            cont = self._text(c.ids, "continuation ids") if isinstance(c, TokenIds) else c
            words = tokens(cont)
            lp = self.likelihoods.get(cont.strip())
            if lp is None:
                keys = [k for k in self.table if text.startswith(k)]
                says = self.table[max(keys, key=len)] if keys else []
                lp = next((s.logprob for s in says if s.text.startswith(cont)), UNKNOWN_LOGPROB)
            out.append(Scored(cont, tuple(word_id(w) for w in words), (lp,) * len(words)))
        ledger.charge(input_tokens=max(1, count_tokens(text)) + sum(len(s.token_ids) for s in out), forward_passes=2)
        return out


@dataclass(frozen=True)
class ScriptedScorer:
    """Scores by candidate text: ``table[text]`` (stripped) or ``fn(text)``; a text it does not
    know raises `KeyError` (a scorer failure, for tests). One scorer call per `score`."""

    table: Mapping[str, float] | None = None
    fn: Callable[[str], float] | None = None
    name: str = "scripted"

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        ledger.charge(scorer_calls=1)
        if self.fn is not None:
            return [float(self.fn(c.text)) for c in candidates]
        assert self.table is not None
        return [float(self.table[c.text.strip()]) for c in candidates]


@dataclass(frozen=True)
class FailingScorer:
    """Always raises ``RuntimeError(message)`` after charging its call."""

    message: str = "scorer crashed"
    name: str = "failing"

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        ledger.charge(scorer_calls=1)
        raise RuntimeError(self.message)


@dataclass
class ScriptedStepScorer:
    """A `StepScorer` from a table: the score of a step is ``table[step.strip()]`` (``default``
    for a step it does not know, or `KeyError` when ``default`` is None). ``calls`` records the
    partial solutions of every call. With ``last_only`` it scores only the last step."""

    table: Mapping[str, float]
    default: float | None = None
    name: str = "scripted_steps"

    def __post_init__(self) -> None:
        self.calls: list[list[list[str]]] = []

    def score_steps(self, prompt: Prompt, partial_steps: Sequence[Sequence[str]], *, ledger: Ledger,
                    last_only: bool = False) -> list[list[float]]:
        ledger.charge(scorer_calls=1)
        self.calls.append([list(p) for p in partial_steps])

        def one(step: str) -> float:
            if step.strip() in self.table or self.default is None:
                return float(self.table[step.strip()])
            return self.default

        return [[one(p[-1])] if last_only else [one(s) for s in p] for p in partial_steps]
