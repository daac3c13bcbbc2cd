"""Constrained decoding on llguidance: outputs match their grammar (JSON Schema, regex, Lark,
choices) for greedy and sampled SmolLM2 rows; the cursor API (mask / advance / rollback /
fork / done); typed errors before any forward pass."""

import dataclasses
import json
import re

import pytest
import torch

from metaloom.constrain import ConstraintSpec, Vocabulary, batch_mask, compile_constraint
from metaloom.errors import InvalidGrammar, InvalidParameter
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def vocab(smollm_generator):
    return smollm_generator.vocabulary


def _ids(vocab, text):
    return vocab.ll.tokenize_str(text)


# --- generation through the local engine -------------------------------------------------------

def test_fifty_sampled_json_outputs_validate(smollm_generator):
    request = dataclasses.replace(
        Request.chat("Give me a color and a size as JSON.", SamplingParams(temperature=1.0, n=50, seed=0, max_tokens=20)),
        constraint=ConstraintSpec.json_schema(SCHEMA))
    out = smollm_generator.generate([request], ledger=Ledger())[0]
    assert len(out) == 50
    for c in out:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in out}) > 1  # sampling still samples


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_outputs_fullmatch(smollm_generator, temperature):
    pattern = r" (19|20)[0-9]{2}, in [A-Z][a-z]+\."
    params = SamplingParams(temperature=temperature, n=1 if temperature == 0 else 12, seed=3, max_tokens=16)
    out = smollm_generator.generate([Request("The author was born in the year", params,
                                             constraint=ConstraintSpec.regex(pattern))], ledger=Ledger())[0]
    for c in out:
        assert c.finish_reason == "stop"
        assert re.fullmatch(pattern, c.text), c.text


def test_choices_return_exactly_one_choice_greedy_and_sampled(smollm_generator):
    options = ["yes", "no", "it depends on the weather"]
    spec = ConstraintSpec.choices(options)
    greedy = Request.chat("Is the sky blue?", SamplingParams(temperature=0, max_tokens=16))
    sampled = Request.chat("Is the sky blue?", SamplingParams(temperature=1.5, n=16, seed=1, max_tokens=16))
    outs = smollm_generator.generate([dataclasses.replace(greedy, constraint=spec),
                                      dataclasses.replace(sampled, constraint=spec)], ledger=Ledger())
    for c in outs[0] + outs[1]:
        assert c.text in options
        assert c.finish_reason == "stop"


def test_lark_grammar_and_batched_requests_with_and_without_constraints(smollm_generator):
    grammar = 'start: "- " NAME "\\n" "- " NAME\nNAME: /[A-Z][a-z]{2,8}/'
    params = SamplingParams(temperature=0.8, n=4, seed=0, max_tokens=14)
    reqs = [Request("Two names:\n", params, constraint=ConstraintSpec.lark(grammar)),
            Request("Two names:\n", dataclasses.replace(params, n=2, max_tokens=5))]
    lark_out, free = smollm_generator.generate(reqs, ledger=Ledger())
    for c in lark_out:
        assert re.fullmatch(r"- [A-Z][a-z]{2,8}\n- [A-Z][a-z]{2,8}", c.text), c.text
    assert [len(c.token_ids) for c in free] == [5, 5] or all(c.finish_reason == "stop" for c in free)


def test_stream_honours_the_constraint(smollm_generator):
    request = dataclasses.replace(Request.chat("Pick a color.", SamplingParams(temperature=0, max_tokens=8)),
                                  constraint=ConstraintSpec.choices(["red", "green", "blue"]))
    chunks = list(smollm_generator.stream(request, ledger=Ledger()))
    assert "".join(ch.text for ch in chunks) in ("red", "green", "blue")
    assert chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("spec", [
    ConstraintSpec.regex("[0-9"),
    ConstraintSpec.regex("[^\\x00-\\x{10FFFF}]"),  # matches nothing
    ConstraintSpec.json_schema({"type": "strin"}),
    ConstraintSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 3}),
    ConstraintSpec.json_schema({"type": "object", "required": ["a"], "additionalProperties": False}),
    ConstraintSpec.lark("start: foo"),
    ConstraintSpec.lark("start: (\"a\""),
    ConstraintSpec.lark('start: "a" start'),  # no finite string: llguidance accepted it and failed mid-generation
    ConstraintSpec.lark('start: b\nb: "q" b | "r" c\nc: c "s"'),
])
def test_invalid_or_unsatisfiable_grammar_is_typed_error_before_any_forward(smollm_generator, spec):
    ledger = Ledger()
    with pytest.raises(InvalidGrammar):
        smollm_generator.generate([Request("Hello", SamplingParams(max_tokens=4)),
                                   Request("Hello", SamplingParams(max_tokens=4), constraint=spec)], ledger=ledger)
    assert ledger.usage.forward_passes == 0
    assert ledger.usage.output_tokens == 0


@pytest.mark.parametrize("make", [
    lambda: ConstraintSpec.choices([]),
    lambda: ConstraintSpec.choices(["a", ""]),
    lambda: ConstraintSpec.json_schema("{not json"),
    lambda: ConstraintSpec.json_schema("[1, 2]"),
    lambda: ConstraintSpec("xml", "<a/>"),
])
def test_malformed_specs_raise_on_construction(make):
    with pytest.raises(InvalidGrammar):
        make()


# --- the cursor API -------------------------------------------------------------------------

def test_rollback_restores_the_mask(vocab):
    cursor = compile_constraint(ConstraintSpec.json_schema(SCHEMA), vocab).cursor()
    tokens = _ids(vocab, '{"color": "green", "size": 7}')
    masks = [cursor.mask()]
    for t in tokens:
        assert masks[-1][t]
        cursor.advance(t)
        masks.append(cursor.mask())
    assert cursor.done() and cursor.accepting()
    cursor.advance(sorted(vocab.eos)[0])  # the end token after the grammar stopped: accepted, rolled back too
    cursor.rollback(1)
    assert torch.equal(cursor.mask(), masks[-1])
    for k in range(len(tokens), 0, -1):
        cursor.rollback(1)
        assert torch.equal(cursor.mask(), masks[k - 1])
    with pytest.raises(InvalidParameter):
        cursor.rollback(1)
    for t in tokens[:3]:  # a rolled-back cursor advances again as before
        cursor.advance(t)
    assert torch.equal(cursor.mask(), masks[3])
    cursor.rollback(3)
    assert torch.equal(cursor.mask(), masks[0])


def test_fork_is_independent(vocab):
    parent = compile_constraint(ConstraintSpec.choices(["red apple", "green pear"]), vocab).cursor()
    child = parent.fork()
    before = parent.mask()
    red, green = _ids(vocab, "red apple"), _ids(vocab, "green pear")
    child.advance(red[0])
    assert torch.equal(parent.mask(), before)
    assert not torch.equal(child.mask(), before)
    parent.advance(green[0])
    assert not parent.mask()[red[1]] and child.mask()[red[1]]
    grandchild = child.fork()
    for t in red[1:]:
        grandchild.advance(t)
    assert grandchild.done() and not child.done()


def test_eos_is_allowed_exactly_when_accepting(vocab):
    cursor = compile_constraint(ConstraintSpec.regex("a+b?"), vocab).cursor()
    eos = sorted(vocab.eos)
    assert not cursor.mask()[eos].any() and not cursor.accepting()
    cursor.advance(_ids(vocab, "a")[0])
    assert cursor.mask()[eos].all() and cursor.accepting() and not cursor.done()
    cursor.advance(_ids(vocab, "b")[0])
    assert cursor.mask()[eos].all() and cursor.done()
    assert int(cursor.mask().sum()) == len(eos)  # only the end may follow


def test_disallowed_token_is_refused_and_leaves_the_cursor_usable(vocab):
    cursor = compile_constraint(ConstraintSpec.regex("[0-9]+"), vocab).cursor()
    before = cursor.mask()
    with pytest.raises(InvalidParameter):
        cursor.advance(_ids(vocab, "x")[0])
    assert torch.equal(cursor.mask(), before)


def test_mask_pads_a_larger_model_vocabulary_with_false(smollm):
    tokenizer_size = smollm.tokenizer.vocab_size
    padded = Vocabulary(smollm.tokenizer, tokenizer_size + 64)
    cursor = compile_constraint(ConstraintSpec.regex("[a-z]+"), padded).cursor()
    mask = cursor.mask()
    assert mask.shape == (tokenizer_size + 64,) and mask.dtype == torch.bool
    assert not mask[tokenizer_size:].any() and mask[:tokenizer_size].any()
    both = batch_mask([cursor, None], tokenizer_size + 64)
    assert both.shape == (2, tokenizer_size + 64) and both[1].all() and torch.equal(both[0], mask)


def test_batch_mask_equals_the_per_row_masks(vocab):
    compiled = compile_constraint(ConstraintSpec.json_schema(SCHEMA), vocab)
    rows = [compiled.cursor() for _ in range(3)]
    tokens = _ids(vocab, '{"color": "')
    for k, row in enumerate(rows):  # rows at different positions
        for t in tokens[: k * 2]:
            row.advance(t)
    expected = torch.stack([r.mask() for r in rows])
    assert torch.equal(batch_mask(rows, vocab.size), expected)
    assert batch_mask([None, None], vocab.size) is None


def test_compiled_once_cursors_start_fresh(vocab):
    compiled = compile_constraint(ConstraintSpec.regex("(ab)+"), vocab)
    a, b = compiled.cursor(), compiled.cursor()
    a.advance(_ids(vocab, "ab")[0])
    assert torch.equal(b.mask(), compiled.cursor().mask())


def test_toy_tokenizer_without_tokenizer_json_decodes_under_a_regex():
    model = MarkovModel.random(6, seed=0)
    gen = LocalGenerator(LoadedModel(model=model, tokenizer=CharTokenizer(6, eos=5), name="toy", folder="",
                                     dtype=torch.float32))
    params = SamplingParams(temperature=1.0, n=20, seed=0, max_tokens=12)
    out = gen.generate([Request("a", params, constraint=ConstraintSpec.regex("(ab|c){2}d"))], ledger=Ledger())[0]
    for c in out:
        assert c.finish_reason == "stop" and re.fullmatch("(ab|c){2}d", c.text), c


# --- JSON Schema property order -----------------------------------------------------------------

ORDERED = {  # declared reasoning-first: not alphabetical, so a sorted schema would flip it
    "type": "object",
    "properties": {"reasoning": {"type": "string", "maxLength": 40}, "answer": {"type": "string", "maxLength": 10}},
    "required": ["reasoning", "answer"],
    "additionalProperties": False,
}


def test_json_schema_spec_keeps_declared_key_order_and_stays_canonical():
    spec = ConstraintSpec.json_schema(ORDERED)
    assert list(json.loads(spec.source)["properties"]) == ["reasoning", "answer"]
    assert list(json.loads(spec.source)) == list(ORDERED)
    again = ConstraintSpec.json_schema(json.loads(json.dumps(ORDERED)))
    text = ConstraintSpec.json_schema(json.dumps(ORDERED, indent=4))  # JSON text: its whitespace is dropped
    assert spec == again == text and hash(spec) == hash(again) == hash(text)
    flipped = {**ORDERED, "properties": dict(reversed(list(ORDERED["properties"].items())))}
    assert ConstraintSpec.json_schema(flipped) != spec  # the order is part of the constraint


def _accepted_prefix(cursor, vocab, text):
    """Feed ``text``'s tokens while the mask allows them; the text the cursor accepted."""
    tokens = _ids(vocab, text)
    for k, t in enumerate(tokens):
        if not cursor.mask()[t]:
            return vocab.ll.decode_str(tokens[:k]) if k else ""
        cursor.advance(t)
    return text


def test_json_schema_output_follows_declared_property_order(vocab):
    compiled = compile_constraint(ConstraintSpec.json_schema(ORDERED), vocab)
    right = '{"reasoning": "x", "answer": "y"}'
    cursor = compiled.cursor()
    assert _accepted_prefix(cursor, vocab, right) == right
    assert cursor.done() and cursor.accepting()
    prefix = _accepted_prefix(compiled.cursor(), vocab, '{"answer": "y", "reasoning": "x"}')
    assert len(prefix) <= len('{"')  # refused at the first key, before any of "answer" is consumed
    after_brace = compiled.cursor()
    assert _accepted_prefix(after_brace, vocab, '{"') == '{"'
    assert not after_brace.mask()[_ids(vocab, "answer")[0]] and after_brace.mask()[_ids(vocab, "reasoning")[0]]


def test_greedy_generation_writes_reasoning_first(smollm_generator):
    request = dataclasses.replace(
        Request.chat("What is 6 times 7? Explain briefly, then answer.", SamplingParams(temperature=0, max_tokens=40)),
        constraint=ConstraintSpec.json_schema(ORDERED))
    (c,) = smollm_generator.generate([request], ledger=Ledger())[0]
    assert c.text.startswith('{"reasoning": "'), c.text
    if c.finish_reason == "stop":
        assert list(json.loads(c.text)) == ["reasoning", "answer"]


def test_a_grammar_engine_that_fails_mid_decode_is_a_typed_error_in_the_batched_masks_too(vocab):
    """llguidance's lexer can give up mid-decode ("too many expressions constructed": a bounded
    repetition intersected with a negation); the failed matcher then allows only the end token.
    That must be an `InvalidGrammar` naming the failure, in the batched masks the decode loop
    uses as in `mask`, never an end token that the cursor then refuses."""
    from metaloom.constrain.grammar import grammar_masks

    spec = ConstraintSpec.lark('start: "T: " LINE\nLINE: /[^\\n]{1,400}/ & ~/.*(Final Answer|Action):.*/\n')
    cursor = compile_constraint(spec, vocab).cursor()
    for t in _ids(vocab, "T: The final answer is 436.0. I now know the final answer. Final Answer"):
        cursor.advance(t)
    with pytest.raises(InvalidGrammar, match="grammar engine failed"):
        grammar_masks([cursor])
    with pytest.raises(InvalidGrammar, match="grammar engine failed"):
        cursor.mask()


def test_a_failed_grammar_engine_ends_only_its_own_row(vocab):
    """The decode loop's masks (`metaloom.decode.select.masks`): a row whose engine failed is
    recorded with why and left out; the other rows of the batch keep their masks."""
    from metaloom.decode.select import masks

    spec = ConstraintSpec.lark('start: "T: " LINE\nLINE: /[^\\n]{1,400}/ & ~/.*(Final Answer|Action):.*/\n')
    failed = compile_constraint(spec, vocab).cursor()
    for t in _ids(vocab, "T: The final answer is 436.0. I now know the final answer. Final Answer"):
        failed.advance(t)
    healthy = compile_constraint(ConstraintSpec.regex("(yes|no)"), vocab).cursor()
    errors: dict[int, str] = {}
    out = masks([failed, healthy, None], vocab.size, torch.device("cpu"), errors)
    assert list(errors) == [0] and "grammar engine failed" in errors[0]
    assert torch.equal(out[1], healthy.mask()) and bool(out[2].all())
