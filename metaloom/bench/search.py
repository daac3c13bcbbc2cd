"""`metaloom bench search`: tree search against sampling baselines on held-out reasoning-gym
problems, at equal FLOPs per problem.

For each problem: greedy, then best-of-N (``--search-n`` samples, ranked by the task's
final-answer checker — an exact checker for countdown and the 24 game, the LLM judge for GSM),
whose FLOPs become that problem's budget; then majority vote and every tree search under a
`Budget` of those FLOPs (each stops cleanly with its best finished solution when it runs out).
The searches score steps with the exact step checker (countdown, 24) or, on GSM, with the
LLM-as-judge step verifier and Monte-Carlo rollouts. Accuracy is reasoning-gym's own
``score_answer`` of the chosen output's final answer, strict on the 24 game's numbers as
`metaloom eval` grades it (`metaloom.eval.tasks.gym.score_answer`).

Each run has its own radix prefix cache (its prompt and paths are reused across its own
calls, no run inherits another's prefill), so FLOPs compare. Records go to ``--search-out``
(JSON Lines, one per problem and strategy, written as each finishes); a re-run with the same
file skips what is done. The summary table is printed at the end (``--json``: one JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from metaloom.bench import model_args, single_weights
from metaloom.errors import InvalidParameter
from metaloom.eval.tasks.gym import TASKS as GYM_TASKS
from metaloom.eval.tasks.gym import chat_prompt, final_answer, score_answer

# the tasks searched: reasoning-gym dataset and configuration (the prompts, configurations and
# answer reading are the evaluation tasks' own, `metaloom.eval.tasks.gym`)
TASKS: dict[str, tuple[str, dict[str, Any]]] = {t: GYM_TASKS[t] for t in ("countdown", "game24", "gsm")}

SEED = 4242  # the tests draw their puzzles with seeds 11-15
SEARCHES = ("step_beam_search", "dvts", "lookahead", "rebase", "mcts", "a_star", "particle_filtering", "best_first",
            "entropic_particle_filtering")


HELP = "tree search against sampling baselines on reasoning-gym problems, at equal FLOPs per problem"


def add_args(p: argparse.ArgumentParser) -> None:
    model_args(p, repeats=None)
    p.add_argument("--search-tasks", default="countdown,game24,gsm", help="tasks, comma-separated")
    p.add_argument("--search-problems", type=int, default=40, help="problems per task")
    p.add_argument("--search-seed", type=int, default=SEED)
    p.add_argument("--search-n", type=int, default=8, help="best-of-N's N, and the searches' beams/particles")
    p.add_argument("--search-tokens", type=int, default=192, help="tokens per solution")
    p.add_argument("--search-strategies", default="", help="only these (comma-separated; default all)")
    p.add_argument("--search-out", default="search-bench.jsonl", help="JSON Lines records (resumed)")
    p.add_argument("--search-dtype", default="float32")


@dataclass(frozen=True)
class Problem:
    task: str
    index: int
    question: str
    entry: dict[str, Any]


def problems(task: str, size: int, seed: int) -> tuple[list[Problem], Any]:
    import reasoning_gym

    name, config = TASKS[task]
    data = reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    return [Problem(task, i, str(x["question"]), x) for i, x in enumerate(data)], data


def grade(p: Problem, data: Any, answer: str | None) -> float:
    """The score of a problem's extracted answer: the evaluation tasks' (`score_answer`:
    reasoning-gym's, strict on the 24 game's numbers); 1.0 is correct."""
    return 0.0 if answer is None else score_answer(p.task, data, answer, p.entry)


def prompt_of(p: Problem) -> tuple[dict[str, str], ...]:
    """The chat a problem is asked as (`metaloom.eval.tasks.gym.chat_prompt`: the step format,
    for the puzzles with one worked example)."""
    return chat_prompt(p.task, p.question)


def strategies(task: str, generator: Any, n: int, tokens: int) -> dict[str, Callable[[], Any]]:
    """name -> a factory of the strategy object for ``task``."""
    from metaloom.meta.best_of_n import BestOfN
    from metaloom.meta.vote import MajorityVote
    from metaloom.sampling.params import SamplingParams
    from metaloom.score.answers import LastNumber
    from metaloom.score.judge import LLMJudge
    from metaloom.score.puzzles import CountdownAnswer, CountdownSteps, Game24Answer, Game24Steps, PuzzleExpression
    from metaloom.score.rollout import RolloutValue
    from metaloom.score.step_judge import StepJudge
    from metaloom.search.a_star import AStar
    from metaloom.search.beam import DVTS, StepBeamSearch
    from metaloom.search.best_first import BestFirst
    from metaloom.search.entropic import EntropicParticleFiltering
    from metaloom.search.lookahead import Lookahead
    from metaloom.search.mcts import MCTS
    from metaloom.search.particle import ParticleFiltering
    from metaloom.search.rebase import Rebase

    params = SamplingParams(temperature=0.8, max_tokens=tokens, seed=0)
    final: Any = {"countdown": CountdownAnswer(), "game24": Game24Answer()}.get(task) or LLMJudge(generator)
    extractor = LastNumber() if task == "gsm" else PuzzleExpression()
    out: dict[str, Callable[[], Any]] = {
        "best_of_n": lambda: BestOfN(n=n, scorer=final, params=params),
        "majority_vote": lambda: MajorityVote(n=n, extractor=extractor, params=params),
    }
    step_scorers: dict[str, Any]
    if task == "gsm":
        step_scorers = {"judge": StepJudge(generator),
                        "rollout": RolloutValue(generator, k=2, extractor=LastNumber(), max_tokens=tokens, seed=0)}
    else:
        step_scorers = {"": CountdownSteps() if task == "countdown" else Game24Steps()}
    # the exact answer checkers also judge each finished solution (a step checker scores steps,
    # not whether a solution that stopped gave the answer)
    outcome = None if task == "gsm" else final
    common: dict[str, Any] = {"params": params, "step_tokens": 48, "final_scorer": outcome}
    goal = 0.0 if task == "gsm" else 1.0  # with an exact checker, only a right answer ends A* / best-first
    searches: dict[str, Callable[[Any], Any]] = {
        "step_beam_search": lambda s: StepBeamSearch(step_scorer=s, n=n, beam_width=max(1, n // 2), **common),
        "dvts": lambda s: DVTS(step_scorer=s, n=n, beam_width=max(1, n // 2), **common),
        "lookahead": lambda s: Lookahead(step_scorer=s, n=n, beam_width=max(1, n // 2), k=1, **common),
        "rebase": lambda s: Rebase(step_scorer=s, n=n, **common),
        "mcts": lambda s: MCTS(step_scorer=s, iterations=64, k=max(2, n // 4), parallel=2, **common),
        "a_star": lambda s: AStar(step_scorer=s, k=max(2, n // 4), parallel=2, max_rounds=64, goal_score=goal, **common),
        "particle_filtering": lambda s: ParticleFiltering(step_scorer=s, n=n, **common),
        "best_first": lambda s: BestFirst(step_scorer=s, k=max(2, n // 4), parallel=2, max_rounds=64, goal_score=goal,
                                          **common),
        "entropic_particle_filtering": lambda s: EntropicParticleFiltering(step_scorer=s, n=n, **common),
    }
    for label, scorer in step_scorers.items():
        for name, make in searches.items():
            out[f"{name}+{label}" if label else name] = (lambda m, sc: lambda: m(sc))(make, scorer)
    return out


def main(args: argparse.Namespace) -> int:
    from metaloom.generator.local import LocalGenerator
    from metaloom.generator.types import Request
    from metaloom.ledger import Budget, Ledger
    from metaloom.models.load import load
    from metaloom.prefix.pool import PrefixCache
    from metaloom.sampling.params import SamplingParams

    tasks = [t for t in args.search_tasks.split(",") if t]
    for t in tasks:
        if t not in TASKS:
            raise InvalidParameter("search-tasks", t, f"one of {sorted(TASKS)}")
    only = {s for s in args.search_strategies.split(",") if s}
    done: set[tuple[str, int, str]] = set()
    records: list[dict[str, Any]] = []
    if os.path.exists(args.search_out):
        with open(args.search_out) as f:
            for line in f:
                r = json.loads(line)
                records.append(r)
                done.add((r["task"], r["problem"], r["strategy"]))
    loaded = load(args.model, dtype=args.search_dtype, weights=single_weights(args))
    print(f"model {args.model} ({args.search_dtype}), load average {os.getloadavg()[0]:.1f}", flush=True)
    with open(args.search_out, "a") as out:
        for task in tasks:
            items, data = problems(task, args.search_problems, args.search_seed)
            names = ["greedy", *strategies(task, None, args.search_n, args.search_tokens)]
            for p in items:
                budget: float | None = next((r["flops"] for r in records if (r["task"], r["problem"], r["strategy"])
                                             == (task, p.index, "best_of_n")), None)
                for name in names:
                    if only and name not in only and name.split("+")[0] not in only and name != "best_of_n":
                        continue
                    if (task, p.index, name) in done:
                        continue
                    ledger = Ledger(budget=Budget(flops=budget) if budget and name not in ("greedy", "best_of_n")
                                    else None)
                    # each run its own radix cache: it reuses its prompt and paths across its own calls
                    # (as a user's would), and no run inherits another's prefill, so FLOPs compare
                    generator = LocalGenerator(loaded, prefix_cache=PrefixCache(512 << 20))
                    table = strategies(task, generator, args.search_n, args.search_tokens)
                    start = time.perf_counter()
                    if name == "greedy":
                        c = generator.generate([Request(prompt_of(p), SamplingParams(temperature=0.0,
                                                max_tokens=args.search_tokens))], ledger=ledger)[0][0]
                        text, stopped = c.text, None
                    else:
                        result = table[name]().run(prompt_of(p), generator, ledger=ledger)
                        text, stopped = result.best, result.stopped_reason
                    seconds = time.perf_counter() - start
                    answer = final_answer(task, text)
                    correct = grade(p, data, answer)
                    u = ledger.usage
                    rec = {"task": task, "problem": p.index, "strategy": name, "correct": correct >= 1.0,
                           "answer": answer, "output_tokens": u.output_tokens, "input_tokens": u.input_tokens,
                           "cached_tokens": u.cached_tokens, "flops": u.flops, "seconds": round(seconds, 3),
                           "scorer_calls": u.scorer_calls, "stopped": stopped, "budget_flops": budget}
                    if name == "best_of_n":
                        budget = u.flops
                    records.append(rec)
                    done.add((task, p.index, name))
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    print(f"{task} #{p.index} {name}: {'ok ' if rec['correct'] else 'no '} {u.output_tokens} tok "
                          f"{u.flops / 1e12:.2f} TFLOP {seconds:.1f}s {stopped or ''}", flush=True)
    summary = summarize(records)
    if args.json:
        print(json.dumps(summary))
    else:
        print(table_text(summary))
    return 0


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["task"], r["strategy"]), []).append(r)
    for (task, name), rs in groups.items():
        out.setdefault(task, {})[name] = {
            "problems": len(rs), "accuracy": sum(r["correct"] for r in rs) / len(rs),
            "output_tokens": statistics.mean(r["output_tokens"] for r in rs),
            "input_tokens": statistics.mean(r["input_tokens"] for r in rs),
            "tflops": statistics.mean(r["flops"] for r in rs) / 1e12,
            "seconds": statistics.mean(r["seconds"] for r in rs),
            "budget_stops": sum(r["stopped"] == "budget" for r in rs)}
    return out


def table_text(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = []
    for task, rows in summary.items():
        lines += [f"\n{task}", "| strategy | problems | accuracy | output tok | input tok | TFLOP | s | budget stops |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, s in sorted(rows.items(), key=lambda kv: -kv[1]["accuracy"]):
            lines.append(f"| {name} | {s['problems']:.0f} | {s['accuracy']:.2f} | {s['output_tokens']:.0f} | "
                         f"{s['input_tokens']:.0f} | {s['tflops']:.2f} | {s['seconds']:.1f} | {s['budget_stops']:.0f} |")
    return "\n".join(lines)
