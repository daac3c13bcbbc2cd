"""An LLM judge through `metaloom serve` costs what it costs on the local engine (issue 30: it
used to cost 2-4x): the same scores, the same forward passes, no generated tokens, and the
tokens computed within one per question of the local engine's with its prefix cache.

Why not exactly equal: a prompt's log-probabilities come back for every position (OpenAI's
``echo``, vLLM's ``prompt_logprobs``), so the server computes the LM head at each position it
runs, where the local prefill computes it for the last one only; and the second of a
question's two prompts ("... Yes", "... No") runs the question's last token again (its
distribution is not kept). Everything the prompts share beyond that is computed once and
charged as cached: sent, not computed."""

from __future__ import annotations

import pytest

from metaloom.decode.score import prompt_logprobs, shared_prompt_logprobs
from metaloom.generator import LocalGenerator
from metaloom.generator.remote import RemoteGenerator
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger, Usage
from metaloom.prefix.pool import PrefixCache
from metaloom.score.judge import LLMJudge
from metaloom.score.step_judge import StepJudge
from metaloom.server.app import create_app
from metaloom.testing.served import serve_app

PROMPT = "What is 2 + 3? Answer with a number."
CANDIDATES = [Completion(t, (), (), "stop") for t in ("5", "The answer is 6.", "2 + 3 = 5, so 5.")]
STEPS = [["Add 2 and 3.\n", "That gives 5.\n"], ["Add 2 and 3.\n", "That gives 6.\n"], ["Multiply 2 by 3.\n"]]


@pytest.fixture(scope="module")
def remote(smollm):
    with serve_app(create_app(LocalGenerator(smollm), model_ids=["default"])) as url, \
            RemoteGenerator(url, "default") as generator:
        yield generator


def computed(u: Usage) -> int:
    return u.input_tokens - u.cached_tokens


def check_costs(smollm, local: Usage, remote: Usage, questions: int, longest: int) -> None:
    """Remote against local (with its prefix cache) for ``questions`` judge questions (a question
    asked twice costs the local engine a forward, the server nothing)."""
    assert remote.output_tokens == local.output_tokens == 0  # nothing generated to read a score
    assert remote.forward_passes <= local.forward_passes
    assert remote.scorer_calls == local.scorer_calls == 1
    assert computed(remote) <= computed(local) + 2 * questions
    head = smollm.model.flops(0, 0, 1)  # the LM head at one position
    extra = smollm.model.flops(1, longest, 0)  # a token run again, at most
    assert remote.flops <= local.flops + head * computed(remote) + extra * 2 * questions


def test_the_judge_through_a_server_scores_and_costs_as_the_local_engine(smollm, remote):
    local = LocalGenerator(smollm, prefix_cache=PrefixCache(budget_bytes=64 << 20))
    mine, theirs = Ledger(), Ledger()
    a = LLMJudge(local).score(PROMPT, CANDIDATES, ledger=mine)
    b = LLMJudge(remote).score(PROMPT, CANDIDATES, ledger=theirs)
    assert b == pytest.approx(a, abs=1e-4)
    check_costs(smollm, mine.usage, theirs.usage, len(CANDIDATES), 128)
    # different questions: the same forwards (a prefill and the Yes/No pair each), at least the tokens
    assert theirs.usage.forward_passes == mine.usage.forward_passes == 2 * len(CANDIDATES)
    assert computed(theirs.usage) >= computed(mine.usage) and theirs.usage.flops >= mine.usage.flops
    # sent: each question twice ("Yes", "No"); what the prompts share is charged as cached
    assert theirs.usage.cached_tokens > theirs.usage.input_tokens // 2


def test_the_step_judge_through_a_server_scores_and_costs_as_the_local_engine(smollm, remote):
    local = LocalGenerator(smollm, prefix_cache=PrefixCache(budget_bytes=64 << 20))
    mine, theirs = Ledger(), Ledger()
    a = StepJudge(local).score_steps(PROMPT, STEPS, ledger=mine)
    b = StepJudge(remote).score_steps(PROMPT, STEPS, ledger=theirs)
    assert [s == pytest.approx(t, abs=1e-4) for s, t in zip(b, a, strict=True)] == [True] * len(STEPS)
    questions = sum(len(s) for s in STEPS)
    check_costs(smollm, mine.usage, theirs.usage, questions, 160)


def test_prompts_that_share_a_beginning_compute_it_once(smollm):
    """`shared_prompt_logprobs` gives each prompt's positions as `prompt_logprobs` alone does, and
    charges what it did not run as cached."""
    generator = LocalGenerator(smollm)
    encode = generator.tokenizer.encode
    prompts = [encode(t) for t in ("Is 2+3=5? Yes", "Is 2+3=5? No", "Is 2+3=6? Yes", "Is 2+3=5? Yes", "Hi", "Hi there")]
    alone = Ledger()
    each = [prompt_logprobs(generator.model, p, 2, alone, pool=generator.pool) for p in prompts]
    together = Ledger()
    shared = shared_prompt_logprobs(generator.model, prompts, 2, together, pool=generator.pool)
    for a, b in zip(each, shared, strict=True):
        assert [(x.token, x.rank, [t for t, _ in x.top]) for x in b] == [(x.token, x.rank, [t for t, _ in x.top]) for x in a]
        assert [x.logprob for x in b] == pytest.approx([x.logprob for x in a], abs=1e-4)
    assert together.usage.input_tokens == alone.usage.input_tokens == sum(map(len, prompts))
    # run: the first "Is 2+3=5? ..." whole, then each one's own tail from the token before it
    # differs; the repeated prompt not at all
    ran = together.usage.input_tokens - together.usage.cached_tokens
    assert 0 < ran < alone.usage.input_tokens
    assert together.usage.forward_passes == 4 and together.usage.flops < alone.usage.flops
