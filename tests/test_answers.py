"""`MathAnswer`: the extracted answer is the final value, never the working that led to it."""

import pytest

from metaloom.score.answers import MathAnswer, classes, expand_scientific


@pytest.mark.parametrize(("text", "answer"), [
    # an equation's answer is its last side, wherever the answer is found
    ("42 - 15 = 27", "27"),
    (r"So she has $\boxed{42 - 15 = 27}$ apples.", "27"),
    (r"The final answer is $\boxed{42 - 15 = 27}$. I hope it is correct.", "27"),
    ("The answer is $42 - 15 = 27$.", "27"),
    ("The answer is 42 - 15 = 27", "27"),
    ("Answer: 42-15=27", "27"),  # math-verify alone says 42
    ("The answer is 42-15=27", "27"),
    ("**Answer:** 42 - 15 = 27", "27"),
    ("First 3+4=7.\nThen 7*6=42.\n$$42 - 15 = 27$$", "27"),
    (r"\[ 42 - 15 = 27 \]", "27"),
    (r"\boxed{x = 5}", "5"),
    (r"$2x+3=7$ so $x=2$", "2"),
    (r"\(x = \frac{1}{2}\)", r"\frac{1}{2}"),
    (r"\boxed{a = b = 3}", "3"),
    (r"The answer is $x = 1,234$.", "1,234"),
    (r"\boxed{42 - 15}", "27"),  # arithmetic on numbers: its value
    (r"\boxed{0.5 + 0.25}", "0.75"),
    ("so the answer is 7. Check: 7 + 1 = 8", "7"),  # the stated answer, not the check after it
    ("The answer is **27**.", "27"),  # was '27**.'
    # what already worked
    ("#### 27", "27"),
    ("She has 27 apples left.", "27"),
    ("The answer is -3.5", "-3.5"),
    ("The answer is 3.5.", "3.5"),
    (r"\boxed{-5}", "-5"),
    (r"\boxed{2.50}", "2.50"),
    (r"so it is $\frac{3}{4}$", r"\frac{3}{4}"),
    (r"$-\frac{3}{4}$", r"-\frac{3}{4}"),
    ("x = 3/4", "3/4"),
    ("The answer is $1,234.50$", "1,234.50"),
    ("1,234", "1234"),
    (r"\boxed{1,000}", "1,000"),
    (r"\boxed{\$18}", "18"),
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}"),
    (r"\boxed{x^2 + 1}", "x^2 + 1"),
    (r"The answer is $x \leq 3$", r"x \leq 3"),  # an inequality is not an equation
    (r"\boxed{x = 1, y = 2}", "x = 1, y = 2"),  # nor is a system's solution cut to its last value
    ("The answer is 10%", "10%"),  # a percentage keeps its sign (was "10")
    # held-out misses of the audit (issue 48): scientific notation is the number it stands for
    ("The distance is 3.0e8 meters.", "300000000"),  # was 3.0
    (r"The answer is 6.02 \times 10^{23}.", "602000000000000000000000"),  # was 10, a value nobody wrote
    ("So the answer is 3.0e8.", "300000000"),
    (r"$6.02 \times 10^{23}$", "602000000000000000000000"),  # was None
    ("The answer is 2.5E-3.", "0.0025"),
    ("The answer is 1.5 x 10^3.", "1500"),
    (r"\boxed{1.6 \times 10^{-19}}", "0.00000000000000000016"),
    ("The speed is 3e8 m/s.", "300000000"),
    ("The answer is 25%.", "25%"),  # was 25
    ("The answer is -25%.", "-25%"),
    (r"The answer is $25\%$.", "25%"),
    ("The answer is 25 percent.", "25%"),
    ("The answer is unclear. Anyway 5 apples.", "5"),
    ("nothing here", None),
    # arithmetic outside a boxed or stated answer is working, never evaluated into a value no
    # sample wrote (it used to give 42 for both)
    ("17 + 25 represents a mix of both numbers.", None),
    ("17 + 25 = 32, so the sum of 17 + 25", "32"),  # its last equation's written result
    ("We need 6 * 7 first", None),
    ("12 = 3 * 4 and then 17 + 25", None),  # no equation here ends in a number
])
def test_math_answer_is_the_final_value(text, answer):
    assert MathAnswer().extract(text) == answer


@pytest.mark.parametrize(("a", "b", "same"), [
    ("27", "27", True),
    (r"\frac{3}{4}", "0.75", True),
    (r"-\frac{3}{4}", "-3/4", True),
    ("1,234.50", "1234.5", True),
    (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt 3}{2}", True),  # LaTeX without delimiters still parses
    ("27", "42", False),
    (r"\frac{3}{4}", "3/5", False),
    ("x^2 + 1", "x^2 - 1", False),  # was True: both read as 1 without delimiters
    ("300000000", "3e8", True),  # a reference written in scientific notation
    ("602000000000000000000000", r"6.02 \times 10^{23}", True),
    ("25%", "0.25", True),  # math-verify reads 25% as 0.25
    ("25%", "0.3", False),
])
def test_math_answers_compare_by_value(a, b, same):
    assert MathAnswer().same(a, b) is same
    assert MathAnswer().same(b, a) is same


def test_a_vote_counts_only_answers_the_samples_wrote():
    m = MathAnswer()
    texts = ["17 + 25 = 32 ... 17 + 25", "17 + 25 represents a mix of both numbers.", "The answer is 42."]
    answers = [m.extract(t) for t in texts]
    assert answers == ["32", None, "42"]
    assert classes(answers, m) == [0, None, 1]  # 42 has one vote, not two


def test_equations_vote_with_their_values():
    m = MathAnswer()
    texts = [r"$\boxed{42 - 15 = 27}$", "27", "Answer: 42-15=27", "The answer is 42.", r"\boxed{27.0}", "no answer"]
    answers = [m.extract(t) for t in texts]
    assert answers == ["27", "27", "27", "42", "27.0", None]
    assert classes(answers, m) == [0, 0, 0, 1, 0, None]


@pytest.mark.parametrize(("text", "expanded"), [
    ("3.0e8 m", "300000000 m"),
    ("-1.5E-2.", "-0.015."),
    (r"6.02 \times 10^{23}", "602000000000000000000000"),
    (r"2 \cdot 10^{-3}", "0.002"),
    ("4 * 10^2 = 400", "400 = 400"),
    (r"1 \times 10^{99}", r"1 \times 10^{99}"),  # past MAX_EXPONENT the power of ten stays
    ("v1e5, 0x1e5, 2e, e5, 3.0e8x", "v1e5, 0x1e5, 2e, e5, 3.0e8x"),  # not numbers in scientific notation
])
def test_scientific_notation_is_written_out(text, expanded):
    assert expand_scientific(text) == expanded


def test_votes_gather_across_notations():
    m = MathAnswer()
    texts = ["The answer is 3.0e8.", r"The answer is $3 \times 10^8$.", "The answer is 300,000,000.", "The answer is 3.0."]
    answers = [m.extract(t) for t in texts]
    assert answers == ["300000000", "300000000", "300000000", "3.0"]
    assert classes(answers, m) == [0, 0, 0, 1]  # 3.0e8 no longer votes with 3.0
