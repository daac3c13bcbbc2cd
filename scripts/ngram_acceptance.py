"""How often prompt lookup's drafts are accepted, by the length of the suffix they matched; not a test.

    python scripts/ngram_acceptance.py [MODEL [PROMPTS]]

MODEL: `metaloom.models.load`'s (default: the default model, native weights, q8 activations);
PROMPTS: grounded, free or both (default), `metaloom bench speculative`'s. Decodes each prompt
greedily (128 tokens), then replays prompt lookup over the greedy text: at every position of
the answer, the longest earlier suffix of 3, 2 or 1 tokens and the 8 tokens after its first
occurrence, and how many of them the greedy text goes on with. Prints, per matched length n,
how many positions matched and P(at least j drafted tokens accepted) for j = 1..8; then the
tokens per target forward of chains of K drafts with ``min_ngram`` 1, 2 and 3 (every position a
match allows drafts, all K verified). Acceptance does not depend on timing: the figures are
exact for the model and prompts.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from metaloom.bench.speculative.prompts import PROMPT_SETS
from metaloom.generator import LocalGenerator, Request
from metaloom.generator.plan import encode
from metaloom.ledger import Ledger
from metaloom.models.load import load
from metaloom.sampling import SamplingParams
from metaloom.speculative.core import greedy_kept
from metaloom.speculative.drafters.ngram import NgramIndex

DEPTH = 8


def draft_at(index: NgramIndex, context: Sequence[int], lowest: int, limit: int) -> tuple[list[int], int]:
    """Prompt lookup's draft (first occurrence) after ``context`` and the suffix length it matched."""
    sizes = range(lowest, 4)
    index.update(context, sizes)
    return index.match(context, sizes, limit)


def accepted(draft: Sequence[int], rest: Sequence[int]) -> int:
    """The drafts greedy decoding keeps where the greedy text goes on with ``rest``."""
    return greedy_kept(rest, draft, min(len(draft), len(rest)))


def by_length(rows: Sequence[tuple[list[int], list[int]]]) -> dict[int, list[int]]:
    """n -> [positions matched, then how many kept at least j = 1..DEPTH drafts]."""
    out: dict[int, list[int]] = {}
    for prompt, answer in rows:
        index = NgramIndex(first=True)
        for i in range(len(answer)):
            draft, n = draft_at(index, prompt + answer[:i], 1, DEPTH)
            if not draft:
                continue
            counts = out.setdefault(n, [0] * (DEPTH + 1))
            counts[0] += 1
            for j in range(accepted(draft, answer[i:])):
                counts[1 + j] += 1
    return out


def chains(rows: Sequence[tuple[list[int], list[int]]], lowest: int, k: int) -> tuple[float, int, int, int]:
    """(tokens per forward, forwards, of them drafted ones, drafted tokens verified)."""
    tokens = forwards = drafted = verified = 0
    for prompt, answer in rows:
        index, i = NgramIndex(first=True), 0
        while i < len(answer):
            draft, _ = draft_at(index, prompt + answer[:i], lowest, k)
            step = accepted(draft, answer[i:]) + 1
            i, tokens, forwards = i + step, tokens + step, forwards + 1
            drafted, verified = drafted + bool(draft), verified + len(draft)
    return tokens / forwards, forwards, drafted, verified


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "default"
    sets = ["grounded", "free"] if len(sys.argv) < 3 or sys.argv[2] == "both" else [sys.argv[2]]
    torch.set_num_threads(2)
    gen = LocalGenerator(load(model, weights="native", activations="q8"))
    for name in sets:
        rows = []
        for text in PROMPT_SETS[name]:
            request = Request.chat(text, SamplingParams(temperature=0, max_tokens=128))
            completion = gen.generate([request], ledger=Ledger())[0][0]
            rows.append((encode(gen, request.prompt), list(completion.token_ids)))
        print(f"{name}: {sum(len(a) for _, a in rows)} tokens")
        for n, counts in sorted(by_length(rows).items()):
            kept = ", ".join(f"{c / counts[0]:.2f}" for c in counts[1:])
            print(f"  matched {n} token(s): {counts[0]} positions; P(>= j kept), j = 1..{DEPTH}: {kept}")
        for lowest in (1, 2, 3):
            line = "; ".join("K={} {:.2f} ({} forwards, {} drafted, {} nodes)".format(k, *chains(rows, lowest, k))
                             for k in (2, 4, 5, 8))
            print(f"  min_ngram {lowest}, tokens per forward: {line}")


if __name__ == "__main__":
    main()
