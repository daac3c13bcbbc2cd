"""Beam search and diverse beam search: toy tables with known answers, equivalence with greedy
and with transformers, batching, the logits pipeline, constraints, accounting and errors."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from metaloom.decode.beam import BeamParams
from metaloom.errors import InvalidParameter
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.testing.table_models import EOS, TableModel, i_have_a_an
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _engine(model, tokenizer):
    return LocalGenerator(LoadedModel(model=model, tokenizer=tokenizer, name="toy", folder="", dtype=torch.float32))


def _table_engine(model: TableModel):
    return _engine(model, model.tokenizer)


def _beam(engine, prompt, params=GREEDY, **beam):
    return engine.generate([Request(prompt, params, decoder=BeamParams(**beam))], ledger=Ledger())[0]


def test_i_have_a_an_greedy_is_myopic_and_beam_two_finds_an_apple():
    engine = _table_engine(i_have_a_an())
    greedy = engine.generate([Request("I have", GREEDY)], ledger=Ledger())[0][0]
    assert greedy.text.split()[0] == "a"
    best, second = _beam(engine, "I have", dataclasses.replace(GREEDY, n=2), beams=2)
    assert best.text == "an apple" and second.text.split()[0] == "a"
    assert best.logprob == pytest.approx(math.log(0.3), abs=1e-6)
    assert best.logprobs == pytest.approx((math.log(0.3), 0.0, 0.0), abs=1e-6)  # an, apple, <eos>
    assert best.score == pytest.approx(math.log(0.3) / 3, abs=1e-6)  # length 3 counts the end token
    assert second.score == pytest.approx(math.log(0.7 / 3) / 3, abs=1e-6)
    assert best.finish_reason == "stop"


def _markov_engine(vocab=7, eos=6, seed=3):
    model = MarkovModel.random(vocab, seed=seed)
    return _engine(model, CharTokenizer(vocab, eos))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_width_one_equals_greedy_toy(seed):
    engine = _markov_engine(seed=seed)
    params = SamplingParams(temperature=0, max_tokens=12)
    for prompt in ["a", "bc", "fed"]:
        greedy = engine.generate([Request(prompt, params)], ledger=Ledger())[0][0]
        for early in (True, False):
            (beam,) = _beam(engine, prompt, params, beams=1, early_stopping=early)
            assert beam.token_ids == greedy.token_ids
            assert beam.logprobs == pytest.approx(greedy.logprobs)


def test_beam_width_one_equals_greedy_real_model(smollm_generator):
    params = SamplingParams(temperature=0, max_tokens=10)
    request = Request.chat("What is the capital of France?", params)
    greedy = smollm_generator.generate([request], ledger=Ledger())[0][0]
    beam = smollm_generator.generate([dataclasses.replace(request, decoder=BeamParams(beams=1))], ledger=Ledger())[0][0]
    assert beam.token_ids == greedy.token_ids
    assert beam.logprobs == pytest.approx(greedy.logprobs, abs=1e-4)


def test_beam_equals_transformers_beam_search(smollm, smollm_generator, hf_smollm):
    tok = smollm.tokenizer
    prompt = "Name a fruit."
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=8, n=3)
    request = dataclasses.replace(Request.chat(prompt, params), decoder=BeamParams(beams=3))
    ours = smollm_generator.generate([request], ledger=Ledger())[0]
    eos = sorted(tok.eos_token_ids)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf_smollm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False, num_beams=3,
                                 num_return_sequences=3, eos_token_id=eos, pad_token_id=eos[0], length_penalty=1.0,
                                 early_stopping=False, return_dict_in_generate=True, output_scores=True)
    for ours_c, seq, score in zip(ours, ref.sequences, ref.sequences_scores, strict=True):
        generated = seq[len(ids):].tolist()
        assert generated[:len(ours_c.token_ids)] == list(ours_c.token_ids)
        assert all(t == eos[0] for t in generated[len(ours_c.token_ids):])
        assert ours_c.score == pytest.approx(float(score), abs=1e-3)


def _length_table() -> TableModel:
    """After "x": "A" (0.5) then the end; "B" (0.35) then "D", "E" (0.95 each) then the end;
    "C" (0.15) then the end. Short "A": sum log 0.5 over 2 tokens; long "B D E": sum
    log(0.35 * 0.95 ** 2) over 4 tokens."""
    words = ["x", "A", "B", "C", "D", "E", EOS]
    table = {("x",): {"A": 0.5, "B": 0.35, "C": 0.15},
             ("x", "A"): {EOS: 1.0}, ("x", "C"): {EOS: 1.0},
             ("x", "B"): {"D": 0.95, EOS: 0.05}, ("x", "B", "D"): {"E": 0.95, EOS: 0.05},
             ("x", "B", "D", "E"): {EOS: 1.0}}
    return TableModel(words, table)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_length_penalty_changes_ranking_as_predicted(alpha):
    engine = _table_engine(_length_table())
    out = _beam(engine, "x", SamplingParams(temperature=0, max_tokens=6, n=2), beams=3, length_penalty=alpha,
                early_stopping="never")
    short, long = math.log(0.5) / 2 ** alpha, math.log(0.35 * 0.95 ** 2) / 4 ** alpha
    expected = "A" if short > long else "B D E"
    assert out[0].text == expected
    assert out[0].score == pytest.approx(max(short, long), abs=1e-6)
    assert out[0].score >= out[1].score
    assert (alpha == 0.0) == (expected == "A")  # the table is built so the penalty flips the winner


def _diverse_table() -> TableModel:
    """"A" is likely (0.85) and has four equally likely continuations; "B", "C", "D" are
    unlikely (0.05 each) and end at once."""
    words = ["p", "A", "B", "C", "D", "a1", "a2", "a3", "a4", EOS]
    table = {("p",): {"A": 0.85, "B": 0.05, "C": 0.05, "D": 0.05},
             ("p", "A"): {"a1": 0.25, "a2": 0.25, "a3": 0.25, "a4": 0.25}}
    return TableModel(words, table)


def test_diverse_beam_search_returns_distinct_groups():
    engine = _table_engine(_diverse_table())
    params = SamplingParams(temperature=0, max_tokens=4, n=4)
    plain = _beam(engine, "p", params, beams=4)
    assert all(c.text.startswith("A ") for c in plain)  # plain beam search spends every beam on "A"
    diverse = _beam(engine, "p", params, beams=4, num_beam_groups=4, diversity_penalty=10.0)
    firsts = [c.text.split()[0] for c in diverse]
    assert sorted(firsts) == ["A", "B", "C", "D"]  # each group starts differently
    assert len({c.token_ids for c in diverse}) == 4
    assert [c.score for c in diverse] == sorted((c.score for c in diverse), reverse=True)
    # the penalty steers selection only: scores stay (length-penalised) log-probabilities
    assert diverse[0].score == pytest.approx(math.log(0.85 * 0.25) / 3, abs=1e-6)


def test_diverse_groups_without_penalty_can_coincide():
    engine = _table_engine(_diverse_table())
    out = _beam(engine, "p", SamplingParams(temperature=0, max_tokens=4, n=2), beams=2, num_beam_groups=2)
    assert out[0].text.startswith("A ") and out[1].text.startswith("A ")


def test_batched_prompts_equal_each_alone_and_n_best_is_ranked():
    engine = _markov_engine(seed=5)
    params = SamplingParams(temperature=0, max_tokens=9, n=3)
    prompts = ["a", "fedcb", "cc"]
    requests = [Request(p, params, decoder=BeamParams(beams=4)) for p in prompts]
    together = engine.generate(requests, ledger=Ledger())
    for request, outs in zip(requests, together, strict=True):
        alone = engine.generate([request], ledger=Ledger())[0]
        assert [c.token_ids for c in outs] == [c.token_ids for c in alone]
        assert len(outs) == 3
        assert [c.score for c in outs] == sorted((c.score for c in outs), reverse=True)
        for c in outs:  # score = sum of per-token log-probabilities / length ** 1
            assert c.score == pytest.approx(sum(c.logprobs) / len(c.token_ids), abs=1e-5)


def test_mixed_decoders_in_one_call_keep_request_order():
    engine = _table_engine(i_have_a_an())
    requests = [Request("I have", GREEDY), Request("I have", GREEDY, decoder=BeamParams(beams=2)), Request("I have", GREEDY)]
    out = engine.generate(requests, ledger=Ledger())
    assert [o[0].text.split()[0] for o in out] == ["a", "an", "a"]
    assert out[1][0].score is not None and out[0][0].score is None


def test_beam_scores_go_through_the_logits_pipeline():
    engine = _table_engine(i_have_a_an())
    an = engine.tokenizer.encode("an")[0]
    biased = SamplingParams(temperature=0, max_tokens=6, logit_bias={an: -5.0})
    (best,) = _beam(engine, "I have", biased, beams=2)
    assert best.text.split()[0] == "a"  # the bias makes "an apple" less likely than "a <fruit>"
    assert best.logprobs[0] == pytest.approx(math.log(0.7), abs=1e-6)  # logprobs stay the raw model's


def test_max_tokens_finishes_with_length_and_ledger_counts_steps():
    model = i_have_a_an()
    engine = _table_engine(model)
    ledger = Ledger()
    out = engine.generate([Request("I have", SamplingParams(temperature=0, max_tokens=1, n=2),
                                   decoder=BeamParams(beams=2))], ledger=ledger)[0]
    assert [c.text for c in out] == ["a", "an"] and {c.finish_reason for c in out} == {"length"}
    assert ledger.usage.forward_passes == 1  # the prefill only: max_tokens=1 needs no decode forward
    ledger = Ledger()
    engine.generate([Request("I have", SamplingParams(temperature=0, max_tokens=5), decoder=BeamParams(beams=2))],
                    ledger=ledger)
    # steps: {a, an} -> {an apple, a fruit} -> both end; prefill + 2 forwards of 2 beams
    assert (ledger.usage.forward_passes, ledger.usage.output_tokens, ledger.usage.input_tokens) == (3, 5, 2)


def test_stream_yields_the_best_hypothesis_once():
    engine = _table_engine(i_have_a_an())
    chunks = list(engine.stream(Request("I have", GREEDY, decoder=BeamParams(beams=2)), ledger=Ledger()))
    assert len(chunks) == 1 and chunks[0].text == "an apple" and chunks[0].finish_reason == "stop"


def test_beam_under_a_choice_constraint(smollm_generator):
    from metaloom.constrain import ConstraintSpec

    choices = ("red", "green", "blue")
    request = Request.chat("What colour is the sky? Answer with one word.", SamplingParams(temperature=0, max_tokens=8, n=2))
    request = dataclasses.replace(request, constraint=ConstraintSpec("choices", choices), decoder=BeamParams(beams=2))
    out = smollm_generator.generate([request], ledger=Ledger())[0]
    assert len(out) == 2 and all(c.text in choices for c in out)
    assert out[0].text != out[1].text


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"beams": 0}, "beams"),
    ({"beams": 2.5}, "beams"),
    ({"beams": 4, "num_beam_groups": 3}, "num_beam_groups"),
    ({"diversity_penalty": -1.0}, "diversity_penalty"),
    ({"length_penalty": float("nan")}, "length_penalty"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
])
def test_bad_beam_parameters_are_typed_errors(kwargs, name):
    with pytest.raises(InvalidParameter) as info:
        BeamParams(**kwargs)
    assert info.value.name == name


@pytest.mark.parametrize(("params", "name"), [
    (SamplingParams(temperature=0.7, max_tokens=4), "temperature"),
    (SamplingParams(top_k=5, max_tokens=4), "sampling adapters"),
    (SamplingParams(n=3, max_tokens=4), "n"),
])
def test_sampling_settings_beam_search_would_ignore_are_errors(params, name):
    engine = _table_engine(i_have_a_an())
    model = engine.model
    with pytest.raises(InvalidParameter) as info:
        engine.generate([Request("I have", params, decoder=BeamParams(beams=2))], ledger=Ledger())
    assert info.value.name == name
    assert model.calls == 0  # validated before any forward


METALOOM = os.path.join(os.path.dirname(sys.executable), "metaloom")


def test_cli_generate_decoder_beam_json():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([METALOOM, "generate", "Name a fruit.", "--decoder", "beam", "--beams", "3", "--n", "2",
                          "--max-tokens", "6", "--length-penalty", "0.5", "--json"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    scores = [c["score"] for c in data["completions"]]
    assert len(scores) == 2 and scores[0] >= scores[1]
    for c in data["completions"]:
        assert c["score"] == pytest.approx(c["logprob"] / len(c["tokens"]) ** 0.5, abs=1e-4)
    bad = subprocess.run([METALOOM, "generate", "hi", "--decoder", "beam", "--beams", "0"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "beams" in bad.stderr
