"""`metaloom train-speculator`: train hierarchical speculator heads for a model on text it generates.

Generates greedy answers to a varied list of instructions with the model itself (the local
engine), computes its hidden states, trains the heads in two phases (causal LM on whole
sequences, then matching the model's own answers; `metaloom.speculative.heads.train`), reports
each stage's held-out accuracy and the expected accepted tokens per step, and saves a
safetensors file that `--speculative heads` (`HeadsDrafter(path=...)`) loads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from metaloom.commands.common import add_model_args, engine_options
from metaloom.errors import InvalidParameter


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-speculator", help="train speculator heads (hierarchical Medusa) for a model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(dtype="bfloat16")  # generation and hidden states: bf16 matmuls are far faster on CPU
    p.add_argument("--out", default=None, help="heads file to write (default: ./<model name>-heads.safetensors)")
    d = p.add_argument_group("data")
    d.add_argument("--samples", type=int, default=480, help="prompts the model answers (training text)")
    d.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    d.add_argument("--batch", type=int, default=48, help="prompts generated together")
    d.add_argument("--documents", type=int, default=64, help="human-written documents for phase 1 (when installed)")
    d.add_argument("--grounded", type=int, default=0,
                   help="input-grounded prompts (summarise/rewrite/correct one of the model's own answers) added")
    d.add_argument("--sampled", type=int, default=0, help="sampled answers (T=0.8) per prompt added as training text")
    d.add_argument("--text", action="append", default=[],
                   help="local plain-text file or folder (.txt/.md/.rst, METADATA) added to the phase 1 text (repeatable)")
    d.add_argument("--text-tokens", type=int, default=100_000, help="at most this many tokens of --text")
    d.add_argument("--data-cache", default=None, help="reuse the generated data saved here (written if missing)")
    d.add_argument("--phase2-text", default="all", choices=("answers", "all"),
                   help="phase 2 matches the model's own output on its answers, or on all text (answers and phase 1 text)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=500, help="optimizer steps, 40%% phase 1 and 60%% phase 2")
    t.add_argument("--phase1-steps", type=int, default=None, help="override the phase 1 share of --steps")
    t.add_argument("--phase2-steps", type=int, default=None, help="override the phase 2 share of --steps")
    t.add_argument("--stages", type=int, default=4, help="head stages (tokens drafted per step at most)")
    t.add_argument("--inner-size", type=int, default=384, help="state size of each stage")
    t.add_argument("--draft-vocab", type=int, default=8192, help="most frequent tokens the heads predict over")
    t.add_argument("--phase1-batch", type=int, default=4, help="whole sequences per phase 1 step")
    t.add_argument("--phase2-batch", type=int, default=64, help="short windows per phase 2 step")
    t.add_argument("--window", type=int, default=16, help="positions per phase 2 window")
    t.add_argument("--lr1", type=float, default=2e-3)
    t.add_argument("--lr2", type=float, default=1e-3)
    t.add_argument("--dropout", type=float, default=0.2, help="dropout on the hidden states while training")
    t.add_argument("--phase2-loss", default="soft", choices=("soft", "argmax"),
                   help="phase 2 matches the model's distribution (soft) or its argmax token")
    t.add_argument("--feature-weight", type=float, default=0.0,
                   help="weight of an EAGLE-style regression of stage outputs onto the model's hidden states")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def engine_answers(loaded: Any, max_tokens: int, batch: int, log: Callable[[str], None],
                   temperature: float = 0.8) -> Callable[[Sequence[str], int, int], list[tuple[list[int], list[int]]]]:
    """The local engine answering chat prompts, ``batch`` rows at a time (`heads.data.Answerer`):
    greedy, or with ``samples`` > 0 that many answers a prompt at ``temperature``, seeded per
    prompt: text in the model's own distribution, which phase 2 labels with its argmax anyway."""
    from metaloom.generator import LocalGenerator, Request
    from metaloom.generator.plan import encode
    from metaloom.ledger import Ledger
    from metaloom.sampling import SamplingParams

    generator = LocalGenerator(loaded)

    def answer(prompts: Sequence[str], samples: int, seed: int) -> list[tuple[list[int], list[int]]]:
        out: list[tuple[list[int], list[int]]] = []
        per = max(1, batch // samples) if samples else batch
        for i in range(0, len(prompts), per):
            requests = [Request.chat(p, SamplingParams(temperature=temperature, n=samples, max_tokens=max_tokens,
                                                       seed=seed + i + j)
                                     if samples else SamplingParams(temperature=0.0, max_tokens=max_tokens))
                        for j, p in enumerate(prompts[i:i + per])]
            for request, completions in zip(requests, generator.generate(requests, ledger=Ledger()), strict=True):
                ids = encode(generator, request.prompt)
                out += [(ids, list(c.token_ids)) for c in completions]
            log(f"  {min(i + per, len(prompts))}/{len(prompts)} prompts answered")
        return out

    return answer


def run(args: argparse.Namespace) -> int:
    import torch

    from metaloom.models import load
    from metaloom.speculative.heads.data import Corpus, build_corpus, text_documents, with_documents
    from metaloom.speculative.heads.model import HeadsConfig, model_probe, model_signature, save_heads
    from metaloom.speculative.heads.train import TrainConfig, evaluate, train

    for name in ("samples", "max_tokens", "batch", "steps"):
        if getattr(args, name) < 1:
            raise InvalidParameter(name, getattr(args, name), "an integer >= 1")
    for name in ("grounded", "sampled", "documents"):
        if getattr(args, name) < 0:
            raise InvalidParameter(name, getattr(args, name), "an integer >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    # dense: the heads learn from (and are matched by) the dequantised weights
    loaded = load(args.model, dtype=args.dtype, device=args.device, backend="native", weights="dense",
                  **engine_options(args))
    phase1 = args.phase1_steps if args.phase1_steps is not None else round(0.4 * args.steps)
    phase2 = args.phase2_steps if args.phase2_steps is not None else args.steps - phase1
    config = TrainConfig(stages=args.stages, inner_size=args.inner_size, draft_vocab=args.draft_vocab,
                         phase1_steps=phase1, phase2_steps=phase2, phase1_batch=args.phase1_batch,
                         phase2_batch=args.phase2_batch, window=args.window, lr1=args.lr1, lr2=args.lr2, seed=args.seed,
                         dropout=args.dropout, weight_decay=args.weight_decay, phase2_loss=args.phase2_loss,
                         feature_weight=args.feature_weight)
    if args.data_cache and os.path.exists(args.data_cache):
        corpus = torch.load(args.data_cache, weights_only=False)
        if not isinstance(corpus, Corpus) or corpus.model_name != loaded.name:
            raise InvalidParameter("data_cache", args.data_cache, f"data generated by {loaded.name} (from this command)")
        log(f"data: {args.data_cache}")
    else:
        answer = engine_answers(loaded, args.max_tokens, args.batch, log)
        corpus = build_corpus(loaded, answer, args.samples, documents=args.documents, seed=args.seed,
                              grounded=args.grounded, sampled=args.sampled, log=log)
        if args.data_cache:
            torch.save(corpus, args.data_cache)
    if args.text:
        t0 = time.perf_counter()
        docs = text_documents(args.text, lambda s: loaded.tokenizer.encode(s, add_special_tokens=False), args.text_tokens)
        corpus = with_documents(corpus, loaded.model, docs)
        log(f"--text: {len(docs)} documents, {sum(len(d) for d in docs)} tokens in {time.perf_counter() - t0:.0f}s")
    data_seconds = time.perf_counter() - started
    model = loaded.model
    identity = HeadsConfig(0, 0, 0, 0, 0, model_name=loaded.name, signature=model_signature(model),
                           probe=model_probe(model))
    from metaloom.models.engine.llama import dense_weight

    embed, lm_head = model.embed.float().cpu(), dense_weight(model.lm_head).float().cpu()  # type: ignore[attr-defined]
    phase2_examples = corpus.answers + (corpus.texts if args.phase2_text == "all" else [])
    heads, report = train(corpus.texts, phase2_examples, embed, lm_head, config, identity,
                          always=sorted(loaded.tokenizer.eos_token_ids), device=model.device, log=log)
    scores = evaluate(heads, corpus.heldout, embed, lm_head)
    out = args.out or f"{loaded.name.lower()}-heads.safetensors"
    save_heads(heads, out)
    summary = {
        "out": out, "bytes": os.path.getsize(out), "model": loaded.name, "stages": config.stages,
        "inner_size": config.inner_size, "draft_vocab": heads.config.draft_vocab,
        "parameters": sum(p.numel() for p in heads.parameters()),
        "answers": len(corpus.answers) + len(corpus.heldout), "phase2_text": args.phase2_text,
        "phase1_tokens": sum(e.tokens.shape[0] - e.start for e in corpus.texts),
        "phase2_tokens": sum(e.tokens.shape[0] - e.start for e in phase2_examples),
        "phase1_loss": _ends(report.phase1_loss), "phase2_loss": _ends(report.phase2_loss),
        "final_stage_loss": [round(x, 3) for x in report.stage_loss],
        "seconds": {"data": round(data_seconds, 1), **{k: round(v, 1) for k, v in report.seconds.items()}},
        "heldout": scores,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        acc = " ".join(f"{a:.2f}" for a in scores["stage_accuracy"])  # type: ignore[attr-defined]
        print(f"wrote {out} ({summary['bytes'] / 2**20:.1f} MiB, {summary['parameters']:,} parameters)")
        print(f"loss phase 1 {summary['phase1_loss']}, phase 2 {summary['phase2_loss']}; seconds {summary['seconds']}")
        print(f"held-out: stage accuracy {acc}; expected accepted tokens per step {scores['mean_accepted']:.2f}")
    return 0


def _ends(curve: list[float], n: int = 10) -> list[float]:
    """Mean loss over the first and the last ``n`` steps."""
    if not curve:
        return []
    return [round(sum(curve[:n]) / len(curve[:n]), 3), round(sum(curve[-n:]) / len(curve[-n:]), 3)]
