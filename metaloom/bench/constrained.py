"""`metaloom bench constrained`: what a grammar costs per generated token, against
unconstrained decoding of the same prompt on the same model, in one run.

For each constraint kind (JSON Schema, regular expression, Lark grammar, choices) and for
unconstrained decoding (end-of-sequence ignored, so it runs the full length):

- ``step ms``: median wall time of one decoding step (forward + pipeline + draw, plus the mask
  and cursor advance when constrained), over every step after the first (the first carries
  the prefill) of ``--repeats`` runs after a warm-up; batch 1 greedy (``--new-tokens`` at
  most) and ``--samples`` sampled rows (``--sample-tokens`` at most);
- ``overhead``: constrained step minus unconstrained step, in ms and as a ratio;
- ``mask µs``: the engine alone, replaying the generated tokens through fresh cursors
  (`batch_mask` + `advance` per step; median per step), and for the batch case the same with
  llguidance's thread pool (``parallel``);
- ``compile ms``: compiling the grammar against the tokenizer (median).

One ``--dtype`` (float32 by default): the mask cost does not depend on the model's dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from metaloom.bench import model_args, single_weights
from metaloom.constrain import ConstraintSpec, GrammarCursor, batch_mask, compile_constraint
from metaloom.constrain.grammar import grammar_masks
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models import load
from metaloom.sampling import SamplingParams

PROMPT = "Describe three people who work at a small bakery: their names, ages and what they do."
LARK = r"""
start: person+
person: "- " NAME ", " AGE ", " JOB "\n"
NAME: /[A-Z][a-z]{1,12}/
AGE: /[1-9][0-9]?/
JOB: /[a-z]+( [a-z]+){0,4}/
"""
SPECS: dict[str, ConstraintSpec] = {
    "json_schema": ConstraintSpec.json_schema({
        "type": "object", "additionalProperties": False, "required": ["people"],
        "properties": {"people": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "age", "job"],
            "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 120},
                           "job": {"enum": ["baker", "cashier", "owner", "delivery driver", "cleaner"]}}}}}}),
    "regex": ConstraintSpec.regex(r"([A-Z][a-z]+ is [1-9][0-9]? years old and works as an? [a-z]+\.\n){1,8}"),
    "lark": ConstraintSpec.lark(LARK),
    "choices": ConstraintSpec.choices([f"{name} the {job}" for name in ("Anna", "Ben", "Carla", "Dev", "Emil")
                                       for job in ("baker", "cashier", "owner", "driver")]),
}


@dataclass(frozen=True)
class Case:
    kind: str
    batch: int
    tokens: int  # generated tokens per row (mean), last repeat
    step_ms: float
    overhead_ms: float
    ratio: float
    mask_us: float
    mask_parallel_us: float | None
    compile_ms: float


def _steps(gen: LocalGenerator, request: Request) -> tuple[list[float], list[list[int]]]:
    """Durations of every decoding step after the first, and the rows' tokens."""
    times: list[float] = []
    batch = gen.new_batch(type(request.decoder))
    try:
        rows = batch.admit(gen.rows_for(request, Ledger()))
        last = time.perf_counter()
        while batch.rows:
            batch.step()
            now = time.perf_counter()
            times.append(now - last)
            last = now
    finally:
        batch.close()
    return times, [list(r.state.tokens) for r in rows]


def _median_steps(gen: LocalGenerator, request: Request, repeats: int) -> tuple[float, list[list[int]]]:
    _steps(gen, request)  # warm-up
    times: list[float] = []
    tokens: list[list[int]] = []
    for _ in range(repeats):
        t, tokens = _steps(gen, request)
        times.extend(t)
    return statistics.median(times) if times else float("nan"), tokens


def _replay_us(gen: LocalGenerator, spec: ConstraintSpec, tokens: list[list[int]], repeats: int,
               parallel: bool = False) -> float:
    """Median µs per step of computing the batch mask and advancing every row's cursor."""
    vocab = gen.vocabulary
    compiled = compile_constraint(spec, vocab)
    per_step: list[float] = []
    for _ in range(repeats):
        cursors = [compiled.cursor() for _ in tokens]
        for step in range(max(len(t) for t in tokens)):
            live = [c if step < len(t) else None for c, t in zip(cursors, tokens, strict=True)]
            start = time.perf_counter()
            if parallel:
                grammar_masks([c for c in live if isinstance(c, GrammarCursor)], parallel=True)
            else:
                batch_mask(live, vocab.size)
            for c, t in zip(live, tokens, strict=True):
                if c is not None:
                    c.advance(t[step])
            per_step.append(time.perf_counter() - start)
    return statistics.median(per_step) * 1e6


def _compile_ms(gen: LocalGenerator, spec: ConstraintSpec, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        compile_constraint(spec, gen.vocabulary)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dtype = args.dtype
    gen = LocalGenerator(load(args.model, dtype=dtype, weights=single_weights(args)))
    start = time.perf_counter()
    gen.vocabulary  # noqa: B018 - built once, timed here
    vocab_s = time.perf_counter() - start
    messages = ({"role": "user", "content": PROMPT},)
    settings = [(1, SamplingParams(temperature=0, max_tokens=args.new_tokens)),
                (args.samples, SamplingParams(temperature=1.0, n=args.samples, seed=0, max_tokens=args.sample_tokens))]
    cases: list[Case] = []
    for batch, params in settings:
        plain = Request(messages, replace(params, ignore_eos=True))
        plain_ms, plain_tokens = _median_steps(gen, plain, args.repeats)
        plain_ms *= 1e3
        cases.append(Case("none", batch, round(float(np.mean([len(t) for t in plain_tokens]))), plain_ms, 0.0, 1.0,
                          0.0, None, 0.0))
        for kind, spec in SPECS.items():
            step_s, tokens = _median_steps(gen, Request(messages, params, constraint=spec), args.repeats)
            step_ms = step_s * 1e3
            cases.append(Case(
                kind, batch, round(float(np.mean([len(t) for t in tokens]))), step_ms, step_ms - plain_ms, step_ms / plain_ms,
                _replay_us(gen, spec, tokens, args.repeats),
                _replay_us(gen, spec, tokens, args.repeats, parallel=True) if batch > 1 else None,
                _compile_ms(gen, spec, args.repeats)))
    return {
        "model": args.model, "dtype": dtype, "device": str(gen.model.device), "threads": torch.get_num_threads(),
        "vocabulary_build_s": vocab_s, "repeats": args.repeats, "cases": [asdict(c) for c in cases],
    }


HELP = "what a grammar costs per generated token, against unconstrained decoding of the same prompt"


def add_args(p: argparse.ArgumentParser) -> None:
    model_args(p, dtypes="float32")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens of the single-sample case")
    p.add_argument("--samples", type=int, default=16, help="samples in the n-samples case")
    p.add_argument("--sample-tokens", type=int, default=64, help="tokens per sample in the n-samples case")

def main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['model']} ({report['dtype']}, {report['device']}, {report['threads']} threads); "
          f"vocabulary built in {report['vocabulary_build_s']:.2f} s; medians over {report['repeats']} runs after a warm-up")
    print(f"{'kind':<12} {'rows':>4} {'tokens':>6} {'step ms':>8} {'overhead ms':>11} {'ratio':>6} "
          f"{'mask µs':>8} {'parallel µs':>11} {'compile ms':>10}")
    for c in report["cases"]:
        par = "" if c["mask_parallel_us"] is None else f"{c['mask_parallel_us']:.0f}"
        print(f"{c['kind']:<12} {c['batch']:>4} {c['tokens']:>6} {c['step_ms']:>8.2f} {c['overhead_ms']:>+11.2f} "
              f"{c['ratio']:>5.2f}x {c['mask_us']:>8.0f} {par:>11} {c['compile_ms']:>10.1f}")
    return 0
