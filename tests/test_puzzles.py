"""Countdown and 24-game checkers: question parsing, exhaustive reachability against brute
force, step scoring (valid, wrong, dead-end, reused, fractional, prose, answer steps),
final-answer scoring in agreement with reasoning-gym's own scorers, safe evaluation."""

import random
from fractions import Fraction

import pytest

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.score import arithmetic
from metaloom.score import puzzles as P
from metaloom.score.answers import Extractor
from metaloom.score.protocols import Scorer, StepScorer

CD_QUESTION = "Calculate 378 using all of these numbers: 94, 4, 7, 5.\nEach number may be used at most once.\n"
G24_QUESTION = "Make 24 using 8, 3, 8, 3. You can only use each number once. You can use the operators +, -, *, /.\n"


def _c(text):
    return Completion(text=text, token_ids=(), logprobs=(), finish_reason="stop")


def _steps(*lines):
    return [line + "\n\n" for line in lines]


def _cd(*lines, **kw):
    return P.check_steps(_steps(*lines), (94, 4, 7, 5), 378, integer_only=kw.pop("integer_only", True), **kw)


def _g24(*lines, numbers=(8, 3, 8, 3)):
    return P.check_steps(_steps(*lines), numbers, 24, integer_only=False)


# -- questions ----------------------------------------------------------------------------


def _datasets():
    import reasoning_gym

    out = []
    for seed in range(11, 16):
        for name in ("countdown", "puzzle24"):
            ds = reasoning_gym.create_dataset(name, size=2, seed=seed)
            out += [(name, ds, entry) for entry in ds]
    return out


@pytest.fixture(scope="module")
def datasets():
    return _datasets()


def test_real_questions_parse_and_their_own_answers_score_one(datasets):
    assert {name for name, _, _ in datasets} == {"countdown", "puzzle24"}
    ledger = Ledger()
    for name, _, entry in datasets:
        q, meta = entry["question"], entry["metadata"]
        parse, scorer = (P.parse_countdown, P.CountdownAnswer()) if name == "countdown" else (P.parse_game24, P.Game24Answer())
        target = meta["target"] if name == "countdown" else 24
        assert parse(q) == (tuple(meta["numbers"]), target)
        assert parse(P.step_prompt(q)) == parse(q)  # the worked example is never read as the puzzle
        texts = [entry["answer"], f"Let me think.\n\nAnswer: {entry['answer']}", f"<answer>{entry['answer']}</answer>",
                 f"Answer: {entry['answer']}\n\n", f"Answer: {entry['answer']} + 1", "Answer: 1 + 2"]
        assert scorer.score(q, [_c(t) for t in texts], ledger=ledger) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert ledger.usage.scorer_calls == len(datasets)


def _variants(answer, numbers):
    """Right and wrong expressions for one puzzle: the answer itself, a number dropped or
    added, an operator changed, a number replaced, the answer reversed in parts."""
    out = [answer, f"{answer} * 1", f"({answer}) - {numbers[0]} + {numbers[0]}", f"({answer}) / 1"]
    for a, b in (("+", "-"), ("-", "+"), ("*", "+"), ("+", "*"), ("/", "*")):
        if a in answer:
            out.append(answer.replace(a, b, 1))
    out.append(" + ".join(map(str, numbers)))
    out.append(" * ".join(map(str, numbers)))
    out.append(" - ".join(map(str, numbers[:-1])))  # one number left out ("at most once" is not enough)
    out.append(answer.replace(str(numbers[0]), str(numbers[0] + 1), 1))
    out += ["", "24", "x + 1", "2 ** 3", "(1 + 2"]
    return out


def test_agrees_with_reasoning_gym_score_answer(datasets):
    checked = right = 0
    for name, ds, entry in datasets:
        numbers = entry["metadata"]["numbers"]
        target = entry["metadata"]["target"] if name == "countdown" else 24
        for expr in _variants(entry["answer"], numbers):
            theirs = ds.score_answer(expr, entry) == 1.0
            ours = P.solves(P.final_expression(expr), numbers, target)
            assert ours == theirs, (name, entry["question"], expr)
            checked += 1
            right += ours
    assert checked > 250 and 20 <= right < checked / 2


def test_puzzle24_stricter_than_reasoning_gym_where_it_is_loose():
    import reasoning_gym

    ds = reasoning_gym.create_dataset("puzzle24", size=1, seed=11)
    entry = ds[0]
    assert sorted(entry["metadata"]["numbers"]) != [1, 1, 4, 6]
    # reasoning-gym passes any four numbers in range ...
    assert ds.score_answer("6 * 4 * 1 * 1", entry) == 1.0
    assert P.Game24Answer().score(entry["question"], [_c("6 * 4 * 1 * 1")], ledger=Ledger()) == [0.0]
    # ... and truncates the value with int(): 7 * 7 / 2 = 24.5 passes
    question = "Make 24 using 7, 7, 2, 1. You can only use each number once. You can use the operators +, -, *, /."
    mine = {"question": question, "answer": "", "metadata": {"numbers": [7, 7, 2, 1]}}
    assert ds.score_answer("7 * 7 / 2 * 1", mine) == 1.0
    assert P.Game24Answer().score(question, [_c("7 * 7 / 2 * 1")], ledger=Ledger()) == [0.0]


def test_bad_questions_raise_typed_errors():
    with pytest.raises(InvalidParameter) as err:
        P.parse_countdown("What is 2 + 2?")
    assert err.value.name == "question"
    with pytest.raises(InvalidParameter):
        P.parse_countdown(G24_QUESTION)  # a 24-game question is not a countdown one
    with pytest.raises(InvalidParameter):
        P.parse_game24(CD_QUESTION)
    with pytest.raises(InvalidParameter):
        P.parse_game24(P.step_prompt("Tell me a joke."))  # the example alone is no puzzle
    with pytest.raises(InvalidParameter):
        P.CountdownSteps().score_steps(G24_QUESTION, [["1 + 2 = 3\n\n"]], ledger=Ledger())
    with pytest.raises(InvalidParameter):
        P.Game24Answer().score(CD_QUESTION, [_c("1")], ledger=Ledger())
    with pytest.raises(InvalidParameter):
        P.CountdownSteps(prose_score=1.5)
    assert P.parse_countdown("Using all the numbers 3, 5, 7, create an expression that equals 26.") == ((3, 5, 7), 26)
    assert P.parse_countdown("Find a way to make 120 using all of these numbers: 1, 2, 3, 4, 5.") == ((1, 2, 3, 4, 5), 120)
    two = "Using all the numbers 3, 5, create an expression that equals 8.\nCalculate 15 using all of these numbers: 3, 5."
    assert P.parse_countdown(two) == ((3, 5), 8)  # the first question in the text


# -- reachability -------------------------------------------------------------------------


def _brute(pool, integer_only):
    """Every value reachable using all of ``pool``: combine any two, recurse (no memo)."""
    if len(pool) == 1:
        return {pool[0]}
    out = set()
    for i in range(len(pool)):
        for j in range(i + 1, len(pool)):
            a, b = pool[i], pool[j]
            rest = pool[:i] + pool[i + 1:j] + pool[j + 1:]
            results = [a + b, a - b, b - a, a * b]
            for x, y in ((a, b), (b, a)):
                if y != 0 and (not integer_only or x % y == 0):
                    results.append(Fraction(x, y))
            for r in set(results):
                out |= _brute([*rest, r], integer_only)
    return out


def test_reachable_matches_brute_force_on_random_pools():
    rng = random.Random(5)
    cases = 0
    for _ in range(30):
        pool = [rng.randint(-2, 12) for _ in range(rng.randint(1, 4))]
        for integer_only in (True, False):
            made = _brute(pool, integer_only)
            targets = rng.sample(sorted(made), min(6, len(made))) + [rng.randint(-30, 80) for _ in range(8)]
            targets += [Fraction(rng.randint(-9, 9), rng.randint(2, 5)) for _ in range(3)]
            for t in targets:
                assert P.reachable(pool, t, integer_only=integer_only) == (t in made), (pool, t, integer_only)
                cases += 1
            # any part of the pool
            t = targets[-4]
            parts = set()
            for mask in range(1, 2 ** len(pool)):
                parts |= _brute([v for k, v in enumerate(pool) if mask >> k & 1], integer_only)
            assert P.reachable(pool, t, integer_only=integer_only, use_all=False) == (t in parts)
    assert cases > 500


def test_reachable_search_path_for_large_parts_matches_brute_force(monkeypatch):
    """Parts above `_DIRECT` numbers are searched instead of enumerated (6 numbers): force
    that path on small pools and compare."""
    monkeypatch.setattr(arithmetic, "_DIRECT", 1)
    arithmetic._reach.cache_clear()
    try:
        rng = random.Random(9)
        for _ in range(6):
            pool = [rng.randint(0, 9) for _ in range(4)]
            for integer_only in (True, False):
                made = _brute(pool, integer_only)
                for t in [*rng.sample(sorted(made), 4), *range(-5, 40, 4)]:
                    assert P.reachable(pool, t, integer_only=integer_only) == (t in made), (pool, t)
    finally:
        arithmetic._reach.cache_clear()


def test_reachable_six_numbers_and_classics():
    assert P.reachable([3, 3, 8, 8], 24, integer_only=False)  # 8 / (3 - 8/3)
    assert not P.reachable([3, 3, 8, 8], 24, integer_only=True)
    assert not P.reachable([1, 1, 1, 1, 1, 1], 10, integer_only=False)  # at most (1+1+1)*(1+1+1)
    assert P.reachable([1, 1, 1, 1, 1, 1], 9, integer_only=True)
    assert P.reachable([100, 75, 50, 25, 6, 3], 952, integer_only=True)  # the famous Countdown game
    assert not P.reachable([], 1, integer_only=True)


# -- steps ----------------------------------------------------------------------------------


def test_a_correct_countdown_solution_scores_one_everywhere():
    assert _cd("Step 1: 94 * 4 = 376", "7 - 5 = 2", "376 + 2 = 378", "Answer: 94 * 4 + 7 - 5") == [1.0] * 4
    assert _cd("7 - 5 = 2", "94 * 4 = 376", "376 + 2 = 378") == [1.0] * 3


def test_the_prompt_example_is_a_valid_solution():
    example = P.STEP_FORMAT.split("target 41:\n", 1)[1]
    steps = [s + "\n\n" for s in example.strip().split("\n\n")]
    assert len(steps) == 4
    assert P.check_steps(steps, (3, 5, 7, 9), 41, integer_only=True) == [1.0] * 4


def test_wrong_arithmetic_and_everything_after_it_score_zero():
    assert _cd("94 * 4 = 366", "7 - 5 = 2", "Answer: 94 * 4 + 7 - 5") == [0.0, 0.0, 0.0]
    assert _cd("94 * 4 = 376", "7 - 5 = 3") == [1.0, 0.0]


def test_a_valid_step_to_a_dead_end_scores_zero():
    assert not P.reachable([98, 7, 5], 378, integer_only=False)
    assert _cd("94 + 4 = 98", "98 * 5 = 490") == [0.0, 0.0]


def test_numbers_must_be_available():
    free = {"reach_limit": 0}  # no reachability search: availability alone decides
    assert _cd("94 * 4 = 376", "94 + 7 = 101", **free) == [1.0, 0.0]  # 94 was consumed
    assert _cd("94 * 4 = 376", "94 * 4 = 376") == [1.0, 0.0]  # 376, 376, 7, 5 could make 378
    assert _cd("8 * 4 = 32", **free) == [0.0]  # never there
    assert _cd("5 * 5 = 25", **free) == [0.0]  # one 5 only
    assert _cd("94 * 4 = 376", "376 - 7 = 369", **free) == [1.0, 1.0]  # a result joins the pool
    # a repeated number may be used as often as it appears
    assert _g24("8 * 8 = 64", numbers=(8, 3, 8, 3)) == [0.0]  # valid, but 64, 3, 3 cannot make 24
    assert P.check_steps(_steps("8 * 8 = 64", "3 * 3 = 9", "3 + 3 = 6"), (8, 3, 8, 3), 24, integer_only=False,
                         **free) == [1.0, 1.0, 0.0]
    assert _g24("6 - 1 = 5", numbers=(1, 6, 3, 6)) == [0.0]  # 5, 3, 6 cannot make 24
    assert _g24("6 + 1 = 7", "7 + 3 = 10", numbers=(1, 6, 3, 6)) == [1.0, 0.0]  # (7 - 3) * 6, but 10, 6 cannot
    assert _g24("6 + 1 = 7", "7 - 3 = 4", "4 * 6 = 24", numbers=(1, 6, 3, 6)) == [1.0, 1.0, 1.0]


def test_countdown_division_must_be_exact_unless_asked():
    assert _cd("94 / 4 = 23.5") == [0.0]
    assert _cd("94 / 4 = 47/2", integer_only=False) == [0.0]  # exact, but 47/2, 7, 5 cannot make 378
    assert P.check_steps(_steps("8 / 4 = 2", "7 / 2 = 7/2"), (8, 4, 7, 2), 7, integer_only=True) == [1.0, 0.0]
    assert P.check_steps(_steps("7 / 2 = 7/2", "7/2 * 8 = 28", "28 / 4 = 7"), (8, 4, 7, 2), 7, integer_only=False) == [1.0] * 3
    assert _cd("94 / 0 = 0") == [0.0]


def test_24_game_fractions():
    good = _g24("8 / 3 = 8/3", "3 - 8/3 = 1/3", "8 / (1/3) = 24", "Answer: 8 / (3 - 8 / 3)")
    assert good == [1.0] * 4
    assert _g24("8 / 3 = 2.67") == [0.0]  # a rounded fraction is wrong arithmetic
    assert P.check_steps(_steps("3 / 8 = 0.375", "8 / 3 = 2.67"), (3, 8, 8, 3), 24, integer_only=False,
                         reach_limit=0) == [1.0, 0.0]  # an exact decimal is fine
    assert _g24("8 / 3 = 8/3", "3 - 8/3 = 0.3333") == [1.0, 0.0]
    assert _g24("8 / 3 = 8/3", "8 - 3 = 5") == [1.0, 0.0]  # valid, but 8/3, 5 cannot make 24
    assert _g24("$8 \\div 3 = \\frac{8}{3}$", "3 − 8/3 = 1/3", "8 ÷ (1/3) = 24") == [1.0] * 3


def test_tolerated_writing():
    for step in ("Step 1: 94 * 4 = 376", "94 x 4 = 376.", "94 × 4 = 376.0", "**Step 1:** 94 \\times 4 = 376",
                 "1. 94 * 4 = 376", "(94 * 4) = 376, leaving 376, 7 and 5", "94*4=376", "(94 * 4 = 376)",
                 "We multiply the two largest.\n94 * 4 = 376\nNow we have 376, 7 and 5."):
        assert _cd(step) == [1.0], step
    assert _cd("5 - 7 = -2", "376 - -2 = 378") == [1.0, 0.0]  # 376 is not there yet
    assert _cd("5 - 7 = -2", "94 * 4 = 376", "376 - -2 = 378") == [1.0, 1.0, 1.0]
    assert _cd("Let me try: 94 * 4 = 376 is close.\n7 - 5 = 2") == [1.0]  # the last line's equation
    assert _cd("94 * 4 = 370\n94 * 4 = 376") == [1.0]


def test_not_one_operation_is_wrong():
    free = {"reach_limit": 0}
    assert _cd("94 * 4 + 2 = 378") == [0.0]  # compound
    assert _cd("94 * 4 = 376 + 2 = 378") == [0.0]  # chain
    assert _cd("94 - 87 = 7 + 5 = 12", **free) == [0.0]  # its tail is no step of its own
    assert _cd("3 * 4 + 7 = 11", **free) == [0.0]  # never read as "4 + 7 = 11"
    assert _cd("94 * * 4 + 7 = 11", **free) == [0.0]
    assert _cd("1. 4 + 7 = 11", **free) == [1.0]  # but a list marker goes
    # "24 / 2 / 3" is (24 / 2) / 3, two operations, not the fraction 24/2 = 12 divided by 3
    assert P.check_steps(_steps("24 / 2 / 3 = 4"), (12, 3, 24, 2), 4, integer_only=False, **free) == [0.0]
    assert P.check_steps(_steps("12 / 3 = 4"), (12, 3, 24, 2), 4, integer_only=False, **free) == [1.0]


def test_prose_scores_prose_score_and_keeps_the_pool():
    assert _cd("Let's look for a big product first.", "94 * 4 = 376") == [0.5, 1.0]
    assert P.check_steps(_steps("Hmm.", "Hmm."), (94, 4, 7, 5), 378, integer_only=True, prose_score=0.2) == [0.2, 0.2]
    assert _cd("94 * 4 = 376", "Now combine the rest.", "7 - 5 = 2", "376 + 2 = 378") == [1.0, 0.5, 1.0, 1.0]
    assert _cd("94 * 4 = 366", "Nice.") == [0.0, 0.0]  # nothing after a mistake scores
    assert _cd("The answer is not obvious.") == [0.5]  # prose, not an answer step
    assert _cd("The answer is close: 94 * 4 = 376") == [1.0]  # only "Answer:" marks the answer step


def test_answer_steps():
    assert _cd("Answer: 94 * 4 + 7 - 5") == [1.0]
    assert _cd("**Answer:** (94 * 4) + (7 - 5) = 378.") == [1.0]
    assert _cd("Answer: 94 * 4 + 2") == [0.0]  # 7 and 5 not used
    assert _cd("Answer: 94 * 4 + 7 + 5") == [0.0]  # 388
    assert _cd("Answer: 94 * 4 + 7 - 5 + 5 - 5") == [0.0]  # 5 used three times
    assert _cd("Answer: 378") == [0.0]
    assert _cd("Answer: 94 * 4 + 7 - 5", "Done!") == [1.0, 1.0]
    assert _cd("Answer: 94 * 4 + 7 + 5", "Done!") == [0.0, 0.0]
    assert _cd("Answer: 94 * 4 + 7 - 5", "Answer: 94 + 4") == [1.0, 0.0]


def test_step_scorers_through_the_protocol():
    ledger = Ledger()
    cd, g24 = P.CountdownSteps(), P.Game24Steps(prose_score=0.3)
    assert isinstance(cd, StepScorer) and isinstance(g24, StepScorer)
    assert (cd.name, g24.name) == ("countdown", "game24")
    partials = [_steps("94 * 4 = 376"), _steps("94 * 4 = 376", "7 - 5 = 3"), []]
    prompt = P.step_prompt(CD_QUESTION)
    assert cd.score_steps(prompt, partials, ledger=ledger) == [[1.0], [1.0, 0.0], []]
    assert cd.score_steps(prompt, partials, ledger=ledger, last_only=True) == [[1.0], [1.0, 0.0], []]
    chat = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": P.step_prompt(G24_QUESTION)})
    assert g24.score_steps(chat, [_steps("Think.", "8 / 3 = 8/3")], ledger=ledger) == [[0.3, 1.0]]
    assert ledger.usage.scorer_calls == 3
    assert P.CountdownSteps(integer_only=False).score_steps(CD_QUESTION, [_steps("94 / 4 = 47/2")], ledger=ledger) == [[0.0]]


def test_large_pools_skip_the_search():
    ones = (1,) * 10  # 10 numbers: no exhaustive search; ten ones cannot make 999 anyway
    steps = _steps("1 + 1 = 2", "2 * 1 = 2")
    assert P.check_steps(steps, ones, 999, integer_only=True) == [1.0, 1.0]
    assert P.check_steps(steps, ones, 999, integer_only=True, reach_limit=9) == [0.0, 0.0]
    assert P.check_steps(_steps("1 + 1 = 3"), ones, 999, integer_only=True) == [0.0]


# -- final answers ------------------------------------------------------------------------


def test_final_expression_and_answer_scorers():
    fe = P.final_expression
    assert fe("94 * 4 = 376\n\nAnswer: 94 * 4 + 7 - 5 = 378.") == "94 * 4 + 7 - 5"
    assert fe("Answer: 1 + 1\n<answer>94*4+7-5</answer>") == "94*4+7-5"
    assert fe("So the answer is (94 * 4) + 7 - 5.") == "(94 * 4) + 7 - 5"
    assert fe("Work.\n94 * 4 + 7 - 5\nThat's it.") == "94 * 4 + 7 - 5"
    assert fe("94 * 4 = 376\n376 + 2 = 378") is None
    assert fe("(Answer: 94*4+7-5)") == "94*4+7-5"
    assert fe("Answer: 1 + 1\nNo, wait.\nAnswer: 94*4+7-5") == "94*4+7-5"  # the last answer line
    assert fe("1 + 1\n94*4+7-5\nDone.") == "94*4+7-5"  # the last bare expression
    assert fe("Answer: with 94 and 4 first, 94 * 4 + 7 - 5") == "94 * 4 + 7 - 5"  # the longest run
    assert fe("Answer: 378 = 94 * 4 + 7 - 5") == "94 * 4 + 7 - 5"
    ledger = Ledger()
    cd = P.CountdownAnswer()
    assert isinstance(cd, Scorer) and cd.name == "countdown" and P.Game24Answer().name == "game24"
    texts = ["94 * 4 = 376\n\n7 - 5 = 2\n\nAnswer: 94 * 4 + 7 - 5", "Answer: 94 × 4 + 7 − 5", "Answer: 94*4+2",
             "no idea", "Answer: __import__('os').system('true')"]
    assert cd.score(CD_QUESTION, [_c(t) for t in texts], ledger=ledger) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert P.Game24Answer().score(G24_QUESTION, [_c("Answer: 8 / (3 - 8 / 3)"), _c("Answer: 8*3")], ledger=ledger) == [1.0, 0.0]
    assert ledger.usage.scorer_calls == 2


def test_expression_extractor():
    ex = P.PuzzleExpression()
    assert isinstance(ex, Extractor)
    assert ex.extract("Answer: 94 * 4 + 7 - 5 = 378") == "94*4+7-5"
    assert ex.extract("Answer: ( 94*4 )+7-5") == "(94*4)+7-5"
    assert ex.extract("nothing here") is None
    assert ex.extract("Answer: 2 ** 3 + 1") is None
    assert ex.same("94*4+7-5", "94*4+7-5") and not ex.same("94*4+7-5", "94*4-5+7")


def test_safe_evaluation():
    assert P.evaluate("(1 + 2) * 3 / 4") == Fraction(9, 4)
    assert P.evaluate("-(3 - 5) * 2") == 4
    assert P.evaluate("8 / (3 - 8 / 3)") == 24
    for bad in ("__import__('os').system('true')", "2 ** 3", "1 / 0", "1.5 + 1", "x + 1", "[1]", "(1 + 2", "9" * 500):
        with pytest.raises(InvalidParameter):
            P.evaluate(bad)
    assert not P.solves("1.0 + 23", (1, 23), 24)  # decimal literals are not the puzzle's numbers
    assert P.solves("23 + 1", (1, 23), 24) and not P.solves(None, (1, 23), 24)
