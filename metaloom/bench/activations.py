"""`metaloom bench activations`: ``--activations q8`` against float activations on the same
native quantised weights, side by side in one run (issue 47).

- **width**: the median seconds of one decode step over ``rows`` rows (each row one new token
  after a ``--context``-token prompt), for each ``--rows`` entry, and its ratio to one row: the
  cost a verify of k drafted tokens or a batch of k samples pays. Twice: each row with its own
  prompt's keys (``separate``: a batch of k requests; each row reads its own cache, so attention
  grows with the rows whatever the products cost) and every row forked from one prefill
  (``shared``: k samples of one prompt, as `LocalGenerator` runs them, or a verify's tokens,
  which read one sequence's keys). Float and q8 alternate within every repeat.
- **samples**: ``--samples`` samples x ``--sample-tokens`` tokens of one prompt (temperature
  0.8, seeded, end-of-sequence ignored) through `LocalGenerator`, median seconds of each.
- **quality**: perplexity of ``--text-tokens`` tokens of held-out text (metaloom's own docs,
  `metaloom.bench.kv.held_out_ids`) under each, and greedy agreement: for each of a few
  prompts, ``--greedy-tokens`` greedy tokens under each, the length of the prefix they share
  and whether they are identical.

q8 quantises each layer matmul's inputs to int8 per 32 (a float32 scale) and multiplies with
integer dot products (quant_q8.h); the output head keeps float inputs. Every figure names the
CPU and the kernel path (``METALOOM_ISA`` forces a lower one).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from metaloom.bench import model_args
from metaloom.bench.kv import held_out_ids, perplexity
from metaloom.bench.timing import paired_median_seconds
from metaloom.errors import InvalidParameter
from metaloom.prefix.radix import common_prefix

HELP = "--activations q8 against float activations on native weights: step cost by rows, samples, perplexity, greedy agreement"
PROMPTS = ("Explain in two sentences why the sky is blue.", "Write a Python function that reverses a string.",
           "List three uses of a paperclip.", "What is the capital of France, and why is it famous?",
           "Summarise the plot of Romeo and Juliet in one paragraph.", "Give me a name for a pet turtle.")


def step_seconds(model: Any, rows: int, context: int, steps: int, shared: bool = False) -> float:
    """Median seconds of a one-token step over ``rows`` rows after a ``context``-token prefill of
    each row (``shared``: one prefill, forked to the rows, which then share its keys)."""
    import time

    ids = torch.arange(context, device=model.device).remainder(model.vocab_size - 1).add(1)
    if shared:
        base = model.new_cache(1, context + steps + 2)
        model.forward(ids[None], base)
        cache = base.fork([0] * rows)
        base.release()
    else:
        cache = model.new_cache(rows, context + steps + 2)
        model.forward(ids.expand(rows, context).contiguous(), cache)
    try:
        token = torch.ones(rows, 1, dtype=torch.long, device=model.device)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            model.forward(token, cache)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:] or times)
    finally:
        cache.release()


def greedy(model: Any, ids: list[int], tokens: int) -> list[int]:
    cache = model.new_cache(1, len(ids) + tokens + 1)
    try:
        logits = model.forward(torch.tensor([ids], device=model.device), cache)[0, -1]
        out = []
        for _ in range(tokens):
            token = int(logits.argmax())
            out.append(token)
            logits = model.forward(torch.tensor([[token]], device=model.device), cache)[0, -1]
        return out
    finally:
        cache.release()


def measure(loaded: Any, rows: list[int], context: int, steps: int, samples: int, sample_tokens: int,
            text_tokens: int, greedy_tokens: int, repeats: int) -> dict[str, Any]:
    from metaloom.generator import LocalGenerator, Request
    from metaloom.generator.types import TokenIds
    from metaloom.ledger import Ledger
    from metaloom.models.engine.native import with_activations
    from metaloom.sampling import SamplingParams

    if loaded.weights != "native":
        raise InvalidParameter("weights", loaded.weights, "native (q8 multiplies the GGUF's quantised blocks)")
    models = {"float": loaded.model, "q8": with_activations(loaded.model, "q8")}
    out: dict[str, Any] = {"rows": rows, "context": context, "samples": samples, "sample_tokens": sample_tokens,
                           "sides": {name: {} for name in models}}
    for prefix, shared in (("", False), ("shared_", True)):
        for r in rows:
            per: dict[str, list[float]] = {name: [] for name in models}
            for _ in range(repeats + 1):  # float and q8 alternate; the first round warms up
                for name, m in models.items():
                    per[name].append(step_seconds(m, r, context, steps, shared))
            for name in models:
                out["sides"][name].setdefault(f"{prefix}step_seconds", {})[str(r)] = statistics.median(per[name][1:])
        for name in models:
            s = out["sides"][name][f"{prefix}step_seconds"]
            out["sides"][name][f"{prefix}width_ratio"] = {k: v / s[str(rows[0])] for k, v in s.items()}
    tok = loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[-1]}]), add_special_tokens=False)
    params = SamplingParams(temperature=0.8, n=samples, max_tokens=sample_tokens, ignore_eos=True, seed=0)
    gens = {name: LocalGenerator(replace(loaded, model=m, activations=name)) for name, m in models.items()}

    def run(g: LocalGenerator) -> Callable[[], object]:
        return lambda: g.generate([Request(TokenIds(tuple(prompt)), params)], ledger=Ledger())

    secs = paired_median_seconds([run(g) for g in gens.values()], repeats)
    for name, s in zip(models, secs, strict=True):
        out["sides"][name]["samples_seconds"] = s
        out["sides"][name]["samples_tok_s"] = samples * sample_tokens / s
    ids = held_out_ids(tok)[:text_tokens + 1]
    for name, m in models.items():
        out["sides"][name]["perplexity"] = perplexity(m, ids, 256)
    agree: list[dict[str, Any]] = []
    for text in PROMPTS:
        p = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        a, b = greedy(models["float"], p, greedy_tokens), greedy(models["q8"], p, greedy_tokens)
        agree.append({"prompt": text, "shared_prefix": common_prefix(a, b), "identical": a == b})
    out["greedy"] = {"tokens": greedy_tokens, "prompts": agree,
                     "identical": sum(g["identical"] for g in agree) / len(agree),
                     "mean_shared_prefix": statistics.mean(g["shared_prefix"] for g in agree)}
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    model_args(p, dtypes="float32", weights=False)
    p.add_argument("--rows", default="1,4,8,16", help="rows per decode step, comma-separated (the first is the base)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    p.add_argument("--steps", type=int, default=8, help="timed one-token steps per measurement")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--sample-tokens", type=int, default=64)
    p.add_argument("--text-tokens", type=int, default=2000, help="tokens of held-out text for perplexity")
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="write the result as JSON here too")


def main(args: argparse.Namespace) -> int:
    from metaloom.models import load
    from metaloom.models.kernels import isa

    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        raise InvalidParameter("rows", args.rows, "comma-separated whole numbers >= 1") from None
    for name, value in (("rows", min(rows, default=0)), ("context", args.context), ("steps", args.steps),
                        ("samples", args.samples), ("sample_tokens", args.sample_tokens),
                        ("text_tokens", args.text_tokens), ("greedy_tokens", args.greedy_tokens),
                        ("repeats", args.repeats)):
        if value < 1:
            raise InvalidParameter(name, value, "a whole number >= 1")
    loaded = load(args.model, dtype=args.dtype, weights="native")
    result = measure(loaded, rows, args.context, args.steps, args.samples, args.sample_tokens, args.text_tokens,
                     args.greedy_tokens, args.repeats)
    result.update(model=loaded.name, dtype=args.dtype, cpu=isa.cpu_name(), isa=isa.chosen().name,
                  threads=torch.get_num_threads())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']} (native weights, {result['dtype']}; {result['cpu']}, {result['isa']} path, "
          f"{result['threads']} threads)")
    print(f"{'':>13} " + " ".join(f"{r:>4} rows" for r in rows) + "  x1 row at the widest  samples tok/s  perplexity")
    for name, s in result["sides"].items():
        for prefix, label in (("", "separate"), ("shared_", "shared")):
            steps = " ".join(f"{1e3 * s[f'{prefix}step_seconds'][str(r)]:>7.2f}ms" for r in rows)
            tail = f"  {s['samples_tok_s']:>13.1f}  {s['perplexity']:>10.3f}" if not prefix else ""
            print(f"{name:>5} {label:>8} {steps}  {s[f'{prefix}width_ratio'][str(rows[-1])]:>20.2f}{tail}")
    g = result["greedy"]
    print(f"greedy, {g['tokens']} tokens, {len(g['prompts'])} prompts: {100 * g['identical']:.0f}% identical, "
          f"mean shared prefix {g['mean_shared_prefix']:.1f} tokens")
    return 0
