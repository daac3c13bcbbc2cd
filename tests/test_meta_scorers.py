"""Scorers, extractors and feedback: reward model, judge read-outs, execution, math-verify."""

import math

import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger, Usage
from metaloom.meta import BestOfN, MajorityVote, Refine
from metaloom.meta.refine import REVISE
from metaloom.score.answers import LastNumber, MathAnswer, classes, execution_outcomes
from metaloom.score.feedback import ExecutionFeedback
from metaloom.score.judge import yes_probability
from metaloom.score.reward_model import RewardModel
from metaloom.testing.scripted import ScriptedGenerator

WORDS = ["[PAD]", "[UNK]", "what", "is", "two", "plus", "two", "four", "five", "it", "maybe", "?"]


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    """A random one-layer GPT-2 sequence classifier and a word-level tokenizer, saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("rm")
    vocab = {w: i for i, w in enumerate(dict.fromkeys(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(folder)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=16, n_layer=1, n_head=2, num_labels=1, pad_token_id=0)
    GPT2ForSequenceClassification(config).eval().save_pretrained(folder)
    return str(folder)


def test_reward_model_scores_match_unpadded_transformers(tiny_rm):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = RewardModel.load(tiny_rm, batch_size=2)
    texts = ["it is four", "maybe five", "four", "two plus two is four ?"]
    cands = [Completion(t, (1,), (0.0,), "stop") for t in texts]
    ledger = Ledger()
    scores = rm.score("what is two plus two ?", cands, ledger=ledger)
    tokenizer = AutoTokenizer.from_pretrained(tiny_rm)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm).eval()
    with torch.no_grad():
        ref = [model(**tokenizer("what is two plus two ?", t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    assert scores == pytest.approx(ref, abs=1e-5)
    assert ledger.usage.scorer_calls == 1 and ledger.usage.output_tokens == 0
    g = ScriptedGenerator({"what is two plus two ?": texts})
    r = BestOfN(n=4, scorer=rm).run("what is two plus two ?", g, ledger=Ledger())
    assert r.best_index == max(range(4), key=lambda i: ref[i])


def test_reward_model_errors(tiny_rm, tmp_path):
    from metaloom.errors import ModelNotFound

    with pytest.raises(ModelNotFound):
        RewardModel.load(str(tmp_path / "missing"))
    with pytest.raises(InvalidParameter, match="label"):
        RewardModel.load(tiny_rm, label=3)


def test_judge_compare_normalises_yes_against_no():
    from metaloom.errors import Unsupported
    from metaloom.generator.capabilities import Capabilities

    g = ScriptedGenerator({}, likelihoods={"Yes": math.log(0.3), "No": math.log(0.1)})
    ledger = Ledger()
    p = yes_probability(g, ["is it?", "really?"], ledger=ledger)
    assert p == pytest.approx([0.75, 0.75])  # 0.3 / (0.3 + 0.1), read by Generator.score
    # one scoring call per question over both words: the question's words ("is it?": 2,
    # "really?": 1) and the two answer words, two forwards each
    assert ledger.usage == Usage(input_tokens=2 + 2 + 1 + 2, forward_passes=4)
    with pytest.raises(InvalidParameter, match="method"):
        yes_probability(g, ["x"], ledger=ledger, method="vibes")
    with pytest.raises(InvalidParameter, match="yes/no"):
        yes_probability(g, ["x"], ledger=ledger, yes="Yes", no="Yes")

    class NoScore(ScriptedGenerator):
        capabilities = Capabilities(features=frozenset({"stream"}))

    with pytest.raises(Unsupported, match="score"):
        yes_probability(NoScore({}), ["x"], ledger=Ledger())


def test_math_answers_are_classed_symbolically():
    m = MathAnswer()
    answers = [m.extract(t) for t in ["so it is $\\frac{3}{4}$", "0.75", "x = 3/4", "1", "nothing"]]
    assert answers[-1] is None
    assert classes(answers, m) == [0, 0, 0, 1, None]
    assert LastNumber().extract("-.5") == "-0.5" and LastNumber().extract("1,234.50 apples") == "1234.5"


CODE_OK = "```python\ndef f(x):\n    return x * 2\n```"
CODE_HALF = "def f(x):\n    return x + 2"
CODE_BAD = "def f(x):\n    return 0"
TESTS = ("assert f(2) == 4", "assert f(3) == 6")


def test_execution_scorer_and_code_outcome_votes():
    from metaloom.score.execution import ExecutionScorer

    g = ScriptedGenerator({"write f": [CODE_HALF, CODE_OK, CODE_BAD]})
    r = BestOfN(n=3, scorer=ExecutionScorer(tests=TESTS, partial_credit=True)).run("write f", g, ledger=Ledger())
    assert r.scores == (0.5, 1.0, 0.0) and r.best_index == 1
    g = ScriptedGenerator({"write f": [CODE_BAD, CODE_OK, CODE_OK.replace("x * 2", "x + x"), CODE_HALF]})
    r = MajorityVote(n=4, extractor=execution_outcomes(TESTS)).run("write f", g, ledger=Ledger())
    assert r.answers == ("FF", "PP", "PP", "PF") and r.best_index == 1


def test_refine_with_failing_test_output():
    first = ExecutionFeedback(TESTS)(("write f"), Completion(CODE_HALF, (), (), "stop"), ledger=Ledger())
    assert not first.passed and first.score == 0.5 and "assert f(3) == 6" in first.message
    table = {"write f": [CODE_HALF], REVISE.format(feedback=first.message): [CODE_OK]}
    r = Refine(feedback=ExecutionFeedback(TESTS), rounds=2).run(
        ({"role": "user", "content": "write f"},), ScriptedGenerator(table), ledger=Ledger())
    assert r.best == CODE_OK and r.scores == (0.5, 1.0)
