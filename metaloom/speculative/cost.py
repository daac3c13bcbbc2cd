"""What a verify forward of n tokens costs on this model and this machine, measured once.

Speculation pays when the tokens a verify yields outweigh what it costs, and that cost is a
property of the model, the kernels and the machine, not of the algorithm: a GPU far from
saturation verifies 16 tokens for about the price of one, while on two CPU cores a quantised
model is compute-bound past a few rows and a 12-token verify costs about four one-token steps
(docs/performance.md). A future kernel (integer dot products on quantised activations,
``--activations q8``) changes the curve again. So the planner (`metaloom.speculative.planner`)
never assumes it: `measure_verify_cost` times forwards of n = 1, 2, 3, 4, 6, ... tokens on a
prefilled cache, each rolled back after it as a rejected draft is, and `VerifyCost` interpolates
between them. The decode loop then rescales it online with the step times it observes (the
planner's ``scale``), so machine load and longer contexts move the level, not the shape.

A forward of B rows of w tokens each is taken to cost what one row of B·w tokens does: on the
CPU the fused verify runs every drafted token as a row of its own (`LlamaModel._verify_fused`),
and in the matmuls rows are rows. Measured after a warm-up round, widths interleaved within each
of `REPEATS` rounds so that drifting load hits them alike, nothing charged to any request; made
once per drafter set-up and kept (`PlannedDrafter`). Each width keeps its least time, not its
median: on a shared machine the noise only adds time, and the table's shape is what the planner
cannot correct online (``scale`` moves the level; it starts at ``typical``, the one-token
step's median over its least, so that a fresh planner does not price plain steps at their best
and read the first drafts' ordinary times as losses). A median of 3 once read SmolLM2's
one-token step as 11.4 ms where it takes about 7 (two of its three forwards caught by other work), and
`monotone` carried that to the 2-token verify: "2 tokens cost what 1 does" made Jacobi verify a
guess every step, and the budget's plain-step baseline covered the loss (issue 47; 0.83x).
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from metaloom.errors import InvalidParameter
from metaloom.models.protocols import LanguageModel

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 65)  # forward widths timed (65: pending + MAX_DRAFT)
CONTEXT = 256  # cached tokens before the timed forwards: a verify reads a context, as decoding does
REPEATS = 5


@dataclass(frozen=True)
class VerifyCost:
    """Seconds of one forward of ``widths[i]`` new tokens (ascending, the first 1: the plain
    step); between them linear, past the last extrapolated along the last segment."""

    widths: tuple[int, ...]
    seconds: tuple[float, ...]
    typical: float = 1.0  # the one-token step's median time over its least: where the planner's scale starts

    def __post_init__(self) -> None:
        if not self.widths or self.widths[0] != 1 or list(self.widths) != sorted(set(self.widths)):
            raise InvalidParameter("widths", list(self.widths), "ascending distinct token counts starting at 1")
        if len(self.seconds) != len(self.widths) or any(not s > 0 for s in self.seconds):
            raise InvalidParameter("seconds", list(self.seconds), f"{len(self.widths)} positive times, one per width")
        if not self.typical >= 1.0:
            raise InvalidParameter("typical", self.typical, "a median over a least time: >= 1")

    def seconds_for(self, tokens: float) -> float:
        """The time of a forward of ``tokens`` new tokens (>= 1; fractional counts interpolate)."""
        n = max(float(tokens), 1.0)
        w, s = self.widths, self.seconds
        if len(w) == 1:
            return s[0] * n
        i = min(max(bisect.bisect_right(w, n) - 1, 0), len(w) - 2)
        if n > w[-1]:  # past the last width: along the last segment
            return s[-1] + max((s[-1] - s[-2]) / (w[-1] - w[-2]), 0.0) * (n - w[-1])
        return s[i] + (s[i + 1] - s[i]) / (w[i + 1] - w[i]) * (n - w[i])

    def relative(self, tokens: float) -> float:
        """`seconds_for` in one-token steps."""
        return self.seconds_for(tokens) / self.seconds[0]

    def to_dict(self) -> dict[str, object]:
        return {"one_token_ms": round(self.seconds[0] * 1e3, 3), "widths": list(self.widths),
                "relative": [round(s / self.seconds[0], 3) for s in self.seconds], "typical": round(self.typical, 3)}


def monotone(seconds: Sequence[float]) -> list[float]:
    """Running maximum: a wider forward never costs less than a narrower one (a timing dip
    would otherwise tell the planner that verifying more tokens saves time)."""
    out: list[float] = []
    for s in seconds:
        out.append(max(s, out[-1]) if out else s)
    return out


def measure_verify_cost(model: LanguageModel, most: int = WIDTHS[-1], context: int = CONTEXT,
                        repeats: int = REPEATS, clock: Callable[[], float] = time.perf_counter,
                        only: bool = False) -> VerifyCost:
    """Time forwards of every width in `WIDTHS` up to ``most`` (and ``most`` itself; ``only``:
    of 1 and ``most`` alone) on one row after ``context`` cached tokens, each rolled back after
    it and each after an untimed one-token forward; the least of ``repeats`` rounds after a
    warm-up round (see the module doc), read on ``clock``. The forwards belong to no request:
    nothing is charged for them."""
    if not isinstance(most, int) or most < 1:
        raise InvalidParameter("most", most, "a forward width >= 1")
    widths = sorted({1, most} if only else {w for w in WIDTHS if w <= most} | {most})
    context = max(1, min(context, model.max_context - widths[-1] - 1))
    times: dict[int, list[float]] = {w: [] for w in widths}
    gen = torch.Generator().manual_seed(0)
    vocab = max(2, min(model.vocab_size, 32000))
    cache = model.new_cache(1, context + widths[-1] + 1)
    try:
        with torch.inference_mode():
            model.forward(torch.randint(1, vocab, (1, context), generator=gen).to(model.device), cache, last_only=True)
            start = cache.lengths.clone()
            for rep in range(repeats + 1):
                for w in widths:
                    # each timed forward after a one-token one, untimed, as a step mostly follows
                    # a plain step: after the widest forward of the round before, a one-token
                    # step took about 10% longer (its activations out of the caches), and read
                    # so, every round, "2 tokens cost what 1 does" (SmolLM2, AMD EPYC Zen 5)
                    model.forward(torch.randint(1, vocab, (1, 1), generator=gen).to(model.device), cache)
                    cache.truncate(start)
                    tokens = torch.randint(1, vocab, (1, w), generator=gen).to(model.device)
                    _sync(model.device)
                    t0 = clock()
                    model.forward(tokens, cache)
                    _sync(model.device)
                    if rep:
                        times[w].append(clock() - t0)
                    cache.truncate(start)
    finally:
        release = getattr(cache, "release", None)
        if release is not None:
            release()
    least = [min(times[w]) for w in widths]
    return VerifyCost(tuple(widths), tuple(monotone(least)), statistics.median(times[1]) / least[0])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
