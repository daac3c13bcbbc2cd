"""First-finish: sample N and keep the first to finish, stopping the rest — shorter
reasoning is often more accurate and always cheaper (Hassid et al. 2025, "Don't Overthink
It"; Agarwal et al. 2025, first-finish search).

"Stop the rest" depends on how the generator is driven:

- ``mode="rounds"`` (any generator): all N samples advance together in rounds of growing
  ``max_tokens`` (``chunk_tokens * growth**r``); after each round, if any sample has
  finished, the shortest finished one wins (earliest on ties) and the others are simply not
  continued. On the local engine each round is one batched call (round 0 prefills the
  prompt once for all N); continuing re-sends prompt + partial text, so the ledger charges
  those input tokens again. The losers ran at most to the end of the winner's round.
- ``mode="stream"``: N streams stepped round-robin, one token each; when one finishes, the
  other streams are closed. On the local engine closing a stream stops its decoding at
  once, but each stream is its own request (its own prefill; the prompt is charged N times)
  and steps with batch 1; on a remote server closing the stream cancels the request.
  Streams carry no log-probabilities, so candidates' logprobs are NaN in this mode.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from metaloom.generator.types import Completion, Generator, Request
from metaloom.ledger import Ledger
from metaloom.meta.helpers import Run, continue_all, default_sampling, ensure, guarded, positive, render, reseed, sample_n
from metaloom.meta.types import Result
from metaloom.sampling.params import SamplingParams
from metaloom.score.protocols import Prompt

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
        ensure(self.growth >= 1.0, "growth", self.growth, ">= 1")
        ensure(self.mode in MODES, "mode", self.mode, f"one of {MODES}")

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        base = render(generator, prompt)
        return guarded(ledger, lambda run: (self._rounds if self.mode == "rounds" else self._stream)(run, generator, base))

    def _rounds(self, run: Run, generator: Generator, base: str) -> None:
        r, used, size = 0, 0, float(self.chunk_tokens)
        while True:
            limit = min(int(size), self.max_tokens - used)
            params = dataclasses.replace(self.params, max_tokens=limit)
            if r == 0:
                run.candidates[:] = sample_n(run, generator, base, params, self.n)
            else:
                run.candidates[:] = continue_all(run, generator, base, run.candidates, params, r)
            used += limit
            finished = [i for i, c in enumerate(run.candidates) if c.finish_reason == "stop"]
            if finished or used >= self.max_tokens:
                break
            r, size = r + 1, size * self.growth
        self._decide(run, finished, rounds=r + 1)

    def _stream(self, run: Run, generator: Generator, base: str) -> None:
        streams = [generator.stream(Request(base, dataclasses.replace(reseed(self.params, i), n=1, max_tokens=self.max_tokens)),
                                    ledger=run.ledger) for i in range(self.n)]
        parts: list[list] = [["", (), None] for _ in range(self.n)]  # text, token ids, finish reason
        live = list(range(self.n))
        try:
            while live and not any(p[2] == "stop" for p in parts):
                for i in list(live):
                    chunk = next(streams[i], None)
                    if chunk is not None:
                        parts[i] = [parts[i][0] + chunk.text, parts[i][1] + chunk.token_ids, chunk.finish_reason]
                    if chunk is None or chunk.finish_reason is not None:
                        live.remove(i)
                    if parts[i][2] == "stop":
                        break
        finally:
            for s in streams:
                close = getattr(s, "close", None)  # a Python generator (local engine, HTTP stream)
                if close is not None:
                    close()  # stop the rest
        run.candidates[:] = [Completion(t, ids, (math.nan,) * len(ids), f or "length") for t, ids, f in parts]
        self._decide(run, [i for i, p in enumerate(parts) if p[2] == "stop"], abandoned=len(live))

    def _decide(self, run: Run, finished: list[int], **data: int) -> None:
        if finished:
            run.best_index = min(finished, key=lambda i: (len(run.candidates[i].token_ids), i))
        else:
            run.best_index = 0
        run.event("first_finish", mode=self.mode, winner=run.best_index if finished else None,
                  finished=len(finished), tokens=[len(c.token_ids) for c in run.candidates], **data)
