"""Strategies on the real default model (SmolLM2-135M-Instruct): the machinery end to end.

The self-consistency test prints its figures (run with ``-s`` to see them): accuracy of
greedy decoding and of majority voting over 8 samples on 20 basic-arithmetic problems from
reasoning-gym (fixed seed), and what each cost."""

import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from metaloom.generator.types import Request
from metaloom.ledger import Ledger, Usage
from metaloom.meta import MajorityVote
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import MathAnswer
from metaloom.score.judge import LLMJudge

pytestmark = pytest.mark.model

MAX_TOKENS = 64
STOP = ("\n\n",)


def arithmetic(size=20, seed=2025):
    reasoning_gym = pytest.importorskip("reasoning_gym")
    return list(reasoning_gym.create_dataset("basic_arithmetic", size=size, seed=seed, min_terms=2, max_terms=2,
                                             min_digits=1, max_digits=2, operators=("+", "-", "*"),
                                             allow_parentheses=False, allow_negation=False))


def chat(question):
    return ({"role": "user", "content": f"{question} Give the final answer as a number."},)


def test_self_consistency_against_greedy_on_basic_arithmetic(smollm_generator):
    gen, math_answer = smollm_generator, MathAnswer()
    problems = arithmetic()
    start = time.perf_counter()
    greedy_ledger = Ledger()
    greedy = gen.generate([Request(chat(p["question"]), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=STOP))
                           for p in problems], ledger=greedy_ledger)
    greedy_answers = [math_answer.extract(g[0].text) for g in greedy]
    greedy_seconds = time.perf_counter() - start

    vote = MajorityVote(n=8, extractor=math_answer,
                        params=SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS, seed=0, stop=STOP))
    parent = Ledger()
    start = time.perf_counter()
    results = [vote.run(chat(p["question"]), gen, ledger=parent) for p in problems]
    vote_seconds = time.perf_counter() - start

    assert len(results) == 20
    total = Usage()
    for p, r in zip(problems, results, strict=True):
        total = total + r.usage
        assert r.stopped_reason is None and len(r.candidates) == 8 and len(r.answers) == 8
        # best-of-8 on one prompt: the prompt is charged once, and 8 rows were decoded
        assert r.usage.input_tokens == len(gen.encode_prompt(chat(p["question"])))
        assert r.usage.output_tokens == sum(len(c.token_ids) for c in r.candidates) <= 8 * MAX_TOKENS
        assert r.usage.forward_passes == max(len(c.token_ids) for c in r.candidates)
        if any(a is not None for a in r.answers):
            assert r.answer is not None
    assert total.output_tokens == parent.usage.output_tokens and total.input_tokens == parent.usage.input_tokens
    assert total.forward_passes == parent.usage.forward_passes
    extracted = sum(a is not None for r in results for a in r.answers)
    assert extracted >= 80  # most samples state a number

    def correct(answer, p):
        return answer is not None and math_answer.same(answer, p["answer"])

    acc_greedy = sum(correct(a, p) for a, p in zip(greedy_answers, problems, strict=True)) / len(problems)
    acc_vote = sum(correct(r.answer, p) for r, p in zip(results, problems, strict=True)) / len(problems)
    print(f"\nbasic_arithmetic x{len(problems)}: greedy accuracy {acc_greedy:.2f} "
          f"({greedy_ledger.usage.output_tokens} output tokens, {greedy_ledger.usage.forward_passes} forwards, "
          f"{greedy_ledger.usage.flops:.3g} FLOPs, {greedy_seconds:.1f} s)")
    print(f"self-consistency@8 accuracy {acc_vote:.2f} (input {parent.usage.input_tokens}, output "
          f"{parent.usage.output_tokens} tokens, {parent.usage.forward_passes} forwards, {parent.usage.flops:.3g} FLOPs, "
          f"{vote_seconds:.1f} s); {extracted}/160 samples gave an answer")


def test_llm_judge_compares_yes_and_no_on_the_real_model(smollm_generator):
    from metaloom.generator.types import Completion

    judge = LLMJudge(smollm_generator)  # method="compare": token ids from the tokenizer
    cands = [Completion("4", (), (), "stop"), Completion("banana", (), (), "stop")]
    ledger = Ledger()
    p = judge.score(({"role": "user", "content": "What is 2 + 2?"},), cands, ledger=ledger)
    assert all(0.0 < x < 1.0 for x in p)
    assert ledger.usage.scorer_calls == 1 and ledger.usage.output_tokens == 4  # two forced tokens per candidate
    assert ledger.usage.forward_passes == 1  # one batched prefill, nothing decoded after the first token
