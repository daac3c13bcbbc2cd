"""`metaloom bench kv --kv-policies`: what token dropping (``--kv-policy``, ``--kv-budget``)
costs in quality and saves in memory and time, each policy against the full cache, side by side
in one run on the same weights and text (`metaloom.bench.kv` has the text and the planted fact).

Token dropping acts while a row decodes, so its protocol differs from the dtype comparison's:

- **perplexity**: the first ``prompt_tokens`` of the text read in one forward (the prompt,
  attended in full, then cut to the budget), and the rest teacher-forced one token a step with
  the policy on, as StreamingLLM evaluates; the continuation's tokens are scored (the prompt's
  are the same for every side).
- **retrieval**: the passage with the planted fact and the sentence to complete read in one
  forward (SnapKV's observation window is then the question's end, as in its paper), 8 tokens
  greedily.
- **memory**: the peak KV bytes the row held (`KVPool.used_bytes` after each step; the prompt's
  own forward, before it is cut, included), and KV bytes per decoded step's row at the end.
- **speed**: batch-1 greedy decode tok/s after the passage (median of alternated rounds).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from metaloom.bench.kv import QUESTION, held_out_ids
from metaloom.errors import InvalidParameter
from metaloom.models.engine.kv_policy import POLICIES, check_policy


def parse_policies(text: str) -> list[tuple[str, int | None]]:
    """``full,streaming:512,h2o:512`` -> [(policy, budget)]; an `InvalidParameter` naming
    ``kv-policies`` for an entry that is not a policy with a valid budget."""
    out: list[tuple[str, int | None]] = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, _, budget = entry.partition(":")
        try:
            value = int(budget) if budget else None
            check_policy(name, value)
        except (ValueError, InvalidParameter) as exc:
            raise InvalidParameter("kv-policies", entry, f"'full' or POLICY:BUDGET with POLICY in {list(POLICIES[1:])} "
                                                         f"and a budget it takes ({exc})") from exc
        if (name, value) not in out:
            out.append((name, value))
    if not out:
        raise InvalidParameter("kv-policies", text, "at least one entry")
    return out


def side_name(policy: str, budget: int | None) -> str:
    return policy if budget is None else f"{policy}:{budget}"


def _step(model: Any, cache: Any, token: int) -> torch.Tensor:
    return model.forward(torch.tensor([[token]], device=model.device), cache)[0, -1]


def perplexity(model: Any, ids: list[int], prompt_tokens: int) -> tuple[float, int]:
    """(exp of the mean NLL of ids[prompt_tokens:] given their prefixes, one token a step after
    the prompt's forward; the peak KV bytes held)."""
    cache = model.new_cache(1, len(ids))
    pool = cache.pool
    try:
        logits = model.forward(torch.tensor([ids[:prompt_tokens]], device=model.device), cache, last_only=True)[0, -1]
        # the prompt's forward wrote all its keys before any policy cut them: its peak
        peak = max(pool.used_bytes, prompt_tokens * pool.bytes_per_slot)
        nll = 0.0
        for at in range(prompt_tokens, len(ids)):
            nll -= float(torch.log_softmax(logits.float(), -1)[ids[at]])
            if at + 1 < len(ids):
                logits = _step(model, cache, ids[at])
                peak = max(peak, pool.used_bytes)
        return math.exp(nll / (len(ids) - prompt_tokens)), peak
    finally:
        cache.release()


def retrieval(model: Any, tokenizer: Any, filler: list[int], depths: list[float], codes: list[str]) -> dict[str, Any]:
    trials = []
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    for code in codes:
        fact = tokenizer.encode(f" The archive code is {code}. ", add_special_tokens=False)
        for depth in depths:
            at = int(len(filler) * depth)
            ids = filler[:at] + fact + filler[at:] + question
            cache = model.new_cache(1, len(ids) + 16)
            try:
                logits = model.forward(torch.tensor([ids], device=model.device), cache, last_only=True)[0, -1]
                out: list[int] = []
                for _ in range(8):
                    token = int(logits.argmax())
                    if token in eos:
                        break
                    out.append(token)
                    logits = _step(model, cache, token)
                answer = tokenizer.decode(out)
            finally:
                cache.release()
            trials.append({"code": code, "depth": depth, "answer": answer, "hit": code in answer})
    return {"exact_match": sum(t["hit"] for t in trials) / len(trials), "trials": trials}


def decode_speed(model: Any, prompt: list[int], tokens: int) -> tuple[float, int]:
    """(batch-1 greedy tok/s after ``prompt``; KV bytes the row holds at the end)."""
    cache = model.new_cache(1, len(prompt) + tokens + 1)
    try:
        token = int(model.forward(torch.tensor([prompt], device=model.device), cache, last_only=True)[0, -1].argmax())
        start = time.perf_counter()
        for _ in range(tokens):
            token = int(_step(model, cache, token).argmax())
        return tokens / (time.perf_counter() - start), cache.pool.used_bytes
    finally:
        cache.release()


def measure(loaded: Any, policies: list[tuple[str, int | None]], text_tokens: int = 4000, prompt_tokens: int = 2000,
            haystack: int = 2000, depths: tuple[float, ...] = (0.1, 0.5, 0.9),
            codes: tuple[str, ...] = ("4817", "2093", "7356"), speed_tokens: int = 64,
            repeats: int = 3) -> dict[str, Any]:
    for name, value in (("text_tokens", text_tokens), ("prompt_tokens", prompt_tokens), ("haystack", haystack),
                        ("speed_tokens", speed_tokens), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise InvalidParameter(name, value, "an integer >= 1")
    if prompt_tokens >= text_tokens:
        raise InvalidParameter("prompt_tokens", prompt_tokens, f"below text_tokens ({text_tokens}): the rest is scored")
    base, tokenizer = loaded.model, loaded.tokenizer
    if not hasattr(base, "with_options"):
        raise InvalidParameter("model", type(base).__name__, "the native model (its KV pool)")
    ids = held_out_ids(tokenizer)
    if len(ids) < max(text_tokens, haystack) or text_tokens > base.max_context or haystack + 64 > base.max_context:
        raise InvalidParameter("text_tokens", text_tokens,
                               f"at most {min(len(ids), base.max_context)} (the text and the context window)")
    models = {side_name(p, b): base.with_options(replace(base.options, kv_policy=p, kv_budget=b)) for p, b in policies}
    out: dict[str, Any] = {"protocol": "policies", "text_tokens": text_tokens, "prompt_tokens": prompt_tokens,
                           "haystack_tokens": haystack, "depths": list(depths), "codes": list(codes), "sides": {}}
    for name, model in models.items():
        ppl, peak = perplexity(model, ids[:text_tokens], prompt_tokens)
        out["sides"][name] = {"kv_dtype": model.options.kv_dtype, "perplexity": ppl, "peak_kv_bytes": peak,
                              "retrieval": retrieval(model, tokenizer, ids[:haystack], list(depths), list(codes))}
    speeds: dict[str, list[float]] = {name: [] for name in models}
    held: dict[str, int] = {}
    for _ in range(repeats):
        for name, model in models.items():
            speed, held[name] = decode_speed(model, ids[:haystack], speed_tokens)
            speeds[name].append(speed)
    for name in models:
        out["sides"][name]["decode_tok_s"] = statistics.median(speeds[name])
        out["sides"][name]["kv_bytes_after_decode"] = held[name]
    return out


def show(result: dict[str, Any]) -> None:
    print(f"{result['model']} ({result['dtype']}, {result['weights']} weights; {result['cpu']}, {result['threads']} "
          f"threads): perplexity of tokens {result['prompt_tokens']}..{result['text_tokens']} of docs/*.md, one a step "
          f"after a {result['prompt_tokens']}-token prompt; a code planted in {result['haystack_tokens']} tokens at "
          f"depths {result['depths']}, {len(result['codes'])} codes")
    print(f"{'policy':>16} {'perplexity':>11} {'peak KV MB':>11} {'retrieval':>10} {'KV MB at end':>13} "
          f"{'decode tok/s':>13}")
    for name, s in result["sides"].items():
        print(f"{name:>16} {s['perplexity']:>11.3f} {s['peak_kv_bytes'] / 2**20:>11.1f} "
              f"{s['retrieval']['exact_match']:>10.2f} {s['kv_bytes_after_decode'] / 2**20:>13.1f} "
              f"{s['decode_tok_s']:>13.1f}")
