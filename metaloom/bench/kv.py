"""`metaloom bench kv`: what a compressed KV cache costs in quality, and what it saves.

For each ``--kv-dtypes`` entry (`metaloom.models.engine.options`: the pool's storage dtype), the
same weights, side by side in one run:

- **perplexity** of a long held-out text, teacher-forced through the cache in chunks of
  ``--chunk`` tokens: every chunk after the first attends to the earlier chunks' keys and
  values as the pool stores them (a single prefill would attend to its own fresh keys and
  never read the stored ones). The text is metaloom's own documentation (docs/*.md, in name
  order): public, long, and not in any model's training data before this project wrote it.
- **retrieval**: a fact ("The archive code is NNNN.") planted at several depths of a long
  passage of that text, the passage and a sentence to complete ("As stated above, the archive
  code is") read into the cache in chunks, then 8 tokens greedily; a hit when the code is in
  them. Depths x codes trials.
- **memory**: KV bytes per token (`KVPool.bytes_per_slot`, scales included), and
- **speed**: batch-1 greedy decode tok/s over a chunked long prompt (median of repeats).

Perplexity and retrieval are deterministic (greedy, fixed text), so one run each; speed takes
the median of ``--repeats`` alternated rounds. Every figure names the CPU.

With ``--kv-policies`` (e.g. ``full,streaming:512,h2o:512,snapkv:512``) it compares token
dropping policies instead, under the protocol `metaloom.bench.kv_drop` describes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metaloom.bench import model_args, single_weights
from metaloom.errors import InvalidParameter
from metaloom.models import load
from metaloom.models.engine.options import KV_DTYPES

HELP = ("a compressed KV cache (--kv-dtype, or --kv-policy with --kv-policies) against the full one: perplexity, "
        "retrieval, memory, speed")
DOCS = Path(__file__).resolve().parents[2] / "docs"
# the question as a continuation to complete, not a chat turn: a 135M model copies a fact it
# read (induction) far more reliably than it follows an instruction about it
QUESTION = "\n\nAs stated above, the archive code is"


def held_out_text(folder: Path = DOCS) -> str:
    """metaloom's documentation, the files in name order (the text perplexity is measured on)."""
    files = sorted(folder.glob("*.md"))
    if not files:
        raise InvalidParameter("docs", str(folder), "a folder with the project's .md documentation")
    return "\n\n".join(f.read_text() for f in files)


def held_out_ids(tokenizer: Any) -> list[int]:
    """`held_out_text` as token ids, with the tokenizer's own special tokens: a model trained
    to read text after a BOS token (Gemma, Llama 3) is scored on it that way (Gemma 3 270M, the
    first 256 tokens of these docs: perplexity 54 after its BOS, 405 without)."""
    return list(tokenizer.encode(held_out_text(), add_special_tokens=True))


def _chunked(model: Any, cache: Any, ids: list[int], chunk: int) -> torch.Tensor:
    """Feed ``ids`` through ``cache`` ``chunk`` tokens a forward; -> logits [len(ids), V]."""
    outs = []
    for at in range(0, len(ids), chunk):
        piece = torch.tensor([ids[at:at + chunk]], device=model.device)
        outs.append(model.forward(piece, cache)[0].float())
    return torch.cat(outs)


def perplexity(model: Any, ids: list[int], chunk: int) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given their prefixes, through the cache."""
    cache = model.new_cache(1, len(ids))
    try:
        logits = _chunked(model, cache, ids, chunk)
    finally:
        cache.release()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=logits.device))
    return math.exp(float(nll))


def _greedy(model: Any, cache: Any, logits: torch.Tensor, tokens: int, eos: set[int]) -> list[int]:
    out: list[int] = []
    for _ in range(tokens):
        token = int(logits[-1].argmax())
        if token in eos:
            break
        out.append(token)
        logits = model.forward(torch.tensor([[token]], device=model.device), cache)[0]
    return out


def retrieval(model: Any, tokenizer: Any, filler: list[int], depths: list[float], codes: list[str],
              chunk: int) -> dict[str, Any]:
    """Exact-match rate of the planted code over depths x codes, and each trial's answer."""
    trials = []
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    for code in codes:
        fact = tokenizer.encode(f" The archive code is {code}. ", add_special_tokens=False)
        for depth in depths:
            at = int(len(filler) * depth)
            ids = filler[:at] + fact + filler[at:] + tokenizer.encode(QUESTION, add_special_tokens=False)
            cache = model.new_cache(1, len(ids) + 16)
            try:
                logits = _chunked(model, cache, ids, chunk)
                answer = tokenizer.decode(_greedy(model, cache, logits, 8, eos))
            finally:
                cache.release()
            trials.append({"code": code, "depth": depth, "answer": answer, "hit": code in answer})
    return {"exact_match": sum(t["hit"] for t in trials) / len(trials), "trials": trials}


def decode_speed(model: Any, prompt: list[int], tokens: int, chunk: int) -> float:
    """Batch-1 greedy decode tok/s after a chunked prefill of ``prompt``."""
    cache = model.new_cache(1, len(prompt) + tokens + 1)
    try:
        logits = _chunked(model, cache, prompt, chunk)
        token = int(logits[-1].argmax())
        start = time.perf_counter()
        for _ in range(tokens):
            token = int(model.forward(torch.tensor([[token]], device=model.device), cache)[0, -1].argmax())
        return tokens / (time.perf_counter() - start)
    finally:
        cache.release()


def measure(loaded: Any, kv_dtypes: list[str], text_tokens: int = 4000, haystack: int = 2000, chunk: int = 256,
            depths: tuple[float, ...] = (0.1, 0.5, 0.9), codes: tuple[str, ...] = ("4817", "2093", "7356"),
            speed_tokens: int = 64, repeats: int = 3) -> dict[str, Any]:
    for name, value in (("text_tokens", text_tokens), ("haystack", haystack), ("chunk", chunk),
                        ("speed_tokens", speed_tokens), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise InvalidParameter(name, value, "an integer >= 1")
    for kv in kv_dtypes:
        if kv not in KV_DTYPES:
            raise InvalidParameter("kv_dtypes", kv, f"names from {list(KV_DTYPES)}")
    base, tokenizer = loaded.model, loaded.tokenizer
    if not hasattr(base, "with_options"):
        raise InvalidParameter("model", type(base).__name__, "the native model (its KV pool)")
    ids = held_out_ids(tokenizer)
    need = text_tokens + 1
    if len(ids) < max(need, haystack) or need > base.max_context or haystack + 64 > base.max_context:
        raise InvalidParameter("text_tokens", text_tokens,
                               f"at most {min(len(ids) - 1, base.max_context - 1)} (the text and the context window)")
    models = {kv: base.with_options(replace(base.options, kv_dtype=kv)) for kv in kv_dtypes}
    out: dict[str, Any] = {"text_tokens": text_tokens, "haystack_tokens": haystack, "chunk": chunk,
                           "depths": list(depths), "codes": list(codes), "sides": {}}
    for kv, model in models.items():
        pool = model.new_pool(slots=2)
        side = {"bytes_per_token": pool.bytes_per_slot, "perplexity": perplexity(model, ids[:need], chunk),
                "retrieval": retrieval(model, tokenizer, ids[:haystack], list(depths), list(codes), chunk)}
        out["sides"][kv] = side
    speeds: dict[str, list[float]] = {kv: [] for kv in models}
    for _ in range(repeats):
        for kv, model in models.items():
            speeds[kv].append(decode_speed(model, ids[:haystack], speed_tokens, chunk))
    for kv in models:
        out["sides"][kv]["decode_tok_s"] = statistics.median(speeds[kv])
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    model_args(p, dtypes="float32")
    p.add_argument("--kv-dtypes", default="auto,bfloat16,int8", help="the pool dtypes to compare, comma-separated "
                                                                      f"({', '.join(KV_DTYPES)}; auto = the model's)")
    p.add_argument("--text-tokens", type=int, default=4000, help="tokens of held-out text for perplexity")
    p.add_argument("--haystack", type=int, default=2000, help="tokens of passage around the planted fact")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward when reading text into the cache")
    p.add_argument("--kv-policies", default=None,
                   help="compare token dropping instead: full and POLICY:BUDGET entries, comma-separated "
                        "(e.g. full,streaming:512,h2o:512,snapkv:512), on the model's own --kv-dtype")
    p.add_argument("--prompt-tokens", type=int, default=2000,
                   help="with --kv-policies: the text's tokens read as one prompt before the rest is scored step by step")


def main(args: argparse.Namespace) -> int:
    from metaloom.bench import kv_drop, names
    from metaloom.models.kernels.isa import cpu_name

    policies = None if args.kv_policies is None else kv_drop.parse_policies(args.kv_policies)
    kv_dtypes = names("kv-dtypes", args.kv_dtypes, KV_DTYPES)
    loaded = load(args.model, dtype=args.dtype, weights=single_weights(args))
    if policies is not None:
        result = kv_drop.measure(loaded, policies, text_tokens=args.text_tokens, prompt_tokens=args.prompt_tokens,
                                 haystack=args.haystack, repeats=args.repeats)
    else:
        result = measure(loaded, kv_dtypes, text_tokens=args.text_tokens, haystack=args.haystack, chunk=args.chunk,
                         repeats=args.repeats)
    result.update(model=loaded.name, dtype=args.dtype, weights=loaded.weights, cpu=cpu_name(),
                  threads=torch.get_num_threads())
    if args.json:
        print(json.dumps(result, default=lambda x: x.item() if isinstance(x, np.generic) else str(x)))
        return 0
    if policies is not None:
        kv_drop.show(result)
        return 0
    print(f"{result['model']} ({result['dtype']}, {result['weights']} weights; {result['cpu']}, {result['threads']} "
          f"threads): perplexity of {result['text_tokens']} tokens of docs/*.md in chunks of {result['chunk']}; "
          f"a code planted in {result['haystack_tokens']} tokens at depths {result['depths']}, "
          f"{len(result['codes'])} codes")
    print(f"{'kv dtype':>9} {'bytes/token':>12} {'perplexity':>11} {'retrieval':>10} {'decode tok/s':>13}")
    for kv, s in result["sides"].items():
        print(f"{kv:>9} {s['bytes_per_token']:>12,} {s['perplexity']:>11.3f} {s['retrieval']['exact_match']:>10.2f} "
              f"{s['decode_tok_s']:>13.1f}")
    return 0
