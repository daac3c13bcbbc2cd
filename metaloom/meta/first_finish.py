"""First-finish: sample N and keep the first to finish, stopping the rest — shorter
reasoning is often more accurate and always cheaper (Hassid et al. 2025, "Don't Overthink
It"; Agarwal et al. 2025, first-finish search).

"Stop the rest" depends on how the generator is driven:

- ``mode="rounds"`` (any generator): all N samples advance together in rounds of growing
  ``max_tokens`` (``chunk_tokens * growth**r``); after each round, if any sample has
  finished, the shortest finished one wins (earliest on ties) and the others are simply not
  continued. On the local engine each round is one batched call (round 0 prefills the
  prompt once for all N); a later round continues each sample from its own tokens
  (`Request.prefix`), so the prompt and the partial answers are charged as input again (as
  cached tokens with a prefix cache). The losers ran at most to the end of the winner's round.
- ``mode="stream"``: one request with N samples, streamed; the first sample to finish ends
  the stream, which cancels the others at once (on the local engine they leave the decode
  loop; on a remote server the request is cancelled). The prompt is prefilled once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from metaloom.generator.types import Completion, Generator, Request
from metaloom.ledger import Ledger
from metaloom.meta.helpers import Run, continue_all, default_sampling, ensure, guarded, positive, sample_n, stop_if_budget
from metaloom.meta.types import Result
from metaloom.sampling.params import SamplingParams
from metaloom.score.protocols import Prompt, as_chat

MODES = ("rounds", "stream")


@dataclass(frozen=True)
class FirstFinish:
    """Sample N and keep the first to finish.

    Up to ``max_tokens`` per sample; if none finishes, the first sample is kept and the
    trace says so. ``params.max_tokens`` is not used."""

    n: int = 4
    chunk_tokens: int = 32
    growth: float = 2.0
    max_tokens: int = 512
    mode: str = "rounds"
    params: SamplingParams = field(default_factory=default_sampling)

    def __post_init__(self) -> None:
        for name in ("n", "chunk_tokens", "max_tokens"):
            positive(name, getattr(self, name))
        g = self.growth
        ensure(isinstance(g, int | float) and not isinstance(g, bool) and math.isfinite(g) and g >= 1.0, "growth", g,
               "a finite number >= 1")
        ensure(self.mode in MODES, "mode", self.mode, f"one of {MODES}")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        return guarded(ledger, lambda run: (self._rounds if self.mode == "rounds" else self._stream)(run, generator, prompt))

    def _rounds(self, run: Run, generator: Generator, prompt: Prompt) -> None:
        r, used, size = 0, 0, float(self.chunk_tokens)
        while True:
            limit = min(int(size), self.max_tokens - used)
            params = dataclasses.replace(self.params, max_tokens=limit)
            if r == 0:
                run.candidates[:] = sample_n(run, generator, prompt, params, self.n)
            else:
                run.candidates[:] = continue_all(run, generator, prompt, run.candidates, params, r)
            stop_if_budget(run, run.candidates)
            used += limit
            finished = [i for i, c in enumerate(run.candidates) if c.finish_reason == "stop"]
            if finished or used >= self.max_tokens:
                break
            r, size = r + 1, size * self.growth
        self._decide(run, finished, rounds=r + 1)

    def _stream(self, run: Run, generator: Generator, prompt: Prompt) -> None:
        params = dataclasses.replace(self.params, n=self.n, max_tokens=self.max_tokens)
        stream = generator.stream(Request(prompt, params), ledger=run.ledger)
        parts: list[list] = [["", (), (), None, None] for _ in range(self.n)]  # text, ids, logprobs, finish, stop reason
        try:
            for chunk in stream:
                part = parts[chunk.index]
                part[:] = [part[0] + chunk.text, part[1] + chunk.token_ids, part[2] + chunk.logprobs,
                           chunk.finish_reason, chunk.stop_reason]
                if chunk.finish_reason == "stop":
                    break  # the first to finish: closing the stream stops the rest
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        run.candidates[:] = [Completion(t, ids, lps, f or "cancelled", s) for t, ids, lps, f, s in parts]
        self._decide(run, [i for i, p in enumerate(parts) if p[3] == "stop"],
                     abandoned=sum(p[3] is None for p in parts))
        stop_if_budget(run, run.candidates)

    def _decide(self, run: Run, finished: list[int], **data: int) -> None:
        if finished:
            run.best_index = min(finished, key=lambda i: (len(run.candidates[i].token_ids), i))
        else:
            run.best_index = 0
        run.event("first_finish", mode=self.mode, winner=run.best_index if finished else None,
                  finished=len(finished), tokens=[len(c.token_ids) for c in run.candidates], **data)
