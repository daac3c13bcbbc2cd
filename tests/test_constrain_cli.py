"""`metaloom generate` constraint flags: --json-schema, --regex, --grammar, --choices, --token-healing."""

import json
import os
import re
import subprocess
import sys

import pytest

from metaloom.cli import build_parser
from metaloom.commands.constraint import constraint_spec
from metaloom.constrain import ConstraintSpec
from metaloom.errors import InvalidGrammar, InvalidParameter

METALOOM = os.path.join(os.path.dirname(sys.executable), "metaloom")


def _spec(*flags):
    return constraint_spec(build_parser().parse_args(["generate", "a prompt", *flags]))


def test_flags_build_the_spec(tmp_path):
    assert _spec() is None
    assert _spec("--choices", "yes,no,maybe") == ConstraintSpec.choices(["yes", "no", "maybe"])
    assert _spec("--choices", "yes", "no, thanks") == ConstraintSpec.choices(["yes", "no, thanks"])
    assert _spec("--regex", "[0-9]+") == ConstraintSpec.regex("[0-9]+")
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "integer"}')
    assert _spec("--json-schema", str(schema)) == ConstraintSpec.json_schema({"type": "integer"})
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "a"')
    assert _spec("--grammar", str(grammar)) == ConstraintSpec.lark('start: "a"')
    assert build_parser().parse_args(["generate", "p", "--token-healing"]).token_healing


def test_bad_flags_are_typed_errors(tmp_path):
    with pytest.raises(InvalidParameter):
        _spec("--json-schema", str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidGrammar):
        _spec("--json-schema", str(bad))
    with pytest.raises(SystemExit):  # at most one constraint
        build_parser().parse_args(["generate", "p", "--regex", "a", "--choices", "a"])


def run(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([METALOOM, "generate", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_cli_choices_json():
    out = run("Is the sky blue?", "--choices", "yes,no", "--temperature", "0", "--max-tokens", "8", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["completions"][0]["text"] in ("yes", "no")


def test_cli_token_healing_with_regex():
    out = run("The url is http:", "--raw", "--token-healing", "--regex", r"//[a-z]{2,12}\.(com|org)",
              "--temperature", "0", "--max-tokens", "12", "--json")
    assert out.returncode == 0, out.stderr
    text = json.loads(out.stdout)["completions"][0]["text"]
    assert text.startswith(":") and re.fullmatch(r"//[a-z]{2,12}\.(com|org)", text[1:]), text


def test_cli_invalid_regex_is_one_error_line():
    out = run("Hello", "--regex", "[0-9", "--max-tokens", "4")
    assert out.returncode == 2
    assert "invalid regex constraint" in out.stderr and "Traceback" not in out.stderr
