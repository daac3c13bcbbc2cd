"""The speculative flags as the CLI spells them: `--speculative quantized` under the default
`--weights auto` loads the dense weights the self-draft requantises (it used to load native
weights and fail with a library-spelled message), `--weights native` with it is refused in CLI
spelling, and `--tree` says which numbers it takes (0 is a whole number)."""

from __future__ import annotations

import pytest

from metaloom.cli import build_parser
from metaloom.commands.speculative import check_speculative_args
from metaloom.errors import InvalidParameter
from metaloom.speculative.tree import TreeShape


def generate_args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["generate", *argv, "hello"])


def test_a_quantised_self_draft_under_weights_auto_loads_dense_weights() -> None:
    args = generate_args("--speculative", "quantized")
    assert args.weights == "auto"
    check_speculative_args(args)
    assert args.weights == "dense"
    args = generate_args("--speculative", "quantized", "--weights", "dense")
    check_speculative_args(args)
    assert args.weights == "dense"
    args = generate_args("--speculative", "ngram")  # other drafters leave the choice alone
    check_speculative_args(args)
    assert args.weights == "auto"


def test_native_weights_with_a_quantised_self_draft_are_refused_in_cli_spelling() -> None:
    with pytest.raises(InvalidParameter) as err:
        check_speculative_args(generate_args("--speculative", "quantized", "--weights", "native"))
    assert err.value.name == "weights" and "--speculative quantized" in err.value.allowed
    assert "weights='dense'" not in str(err.value)


@pytest.mark.parametrize("text", ["static:0,2", "dynamic:0", "static:a,2", "static:", "dynamic:3,4", "static:1.5"])
def test_a_bad_tree_shape_says_whole_numbers_at_least_one(text: str) -> None:
    with pytest.raises(InvalidParameter, match=r"whole numbers >= 1"):
        TreeShape.parse(text)


def test_good_tree_shapes_parse() -> None:
    assert TreeShape.parse("static:4,2").widths == (4, 2) and TreeShape.parse("dynamic:12").nodes == 12
    with pytest.raises(InvalidParameter, match=r"static:W1,W2,\.\.\. \(widths per depth\)"):
        TreeShape.parse("wide:3")
