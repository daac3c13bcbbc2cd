"""Contrastive decoding and classifier-free guidance: the formulas on hand-made vectors, the
lockstep pair on toy models (greedy and sampling), accounting, the truncated amateur, and
typed errors."""

import dataclasses
import math

import pytest
import torch

from metaloom.decode.contrastive import (
    LockstepPair,
    PairCache,
    contrastive_scores,
    guidance_scores,
    truncated_llama,
)
from metaloom.decode.specs import ContrastiveParams, GuidanceParams
from metaloom.errors import InvalidParameter, Unsupported
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.testing.stats import assert_samples_match
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

# next-token probabilities, the same after every token (tokens a b c d)
EXPERT = [0.5, 0.3, 0.15, 0.05]
AMATEUR = [0.6, 0.1, 0.04, 0.001]  # unnormalised: the softmax renormalises


def _constant(probs):
    row = torch.tensor(probs).log()
    return MarkovModel(row.expand(len(probs), -1).clone())


def _engine(model, amateur=None, vocab=4):
    loaded = LoadedModel(model=model, tokenizer=CharTokenizer(vocab), name="toy", folder="", dtype=torch.float32)
    return LocalGenerator(loaded, amateur=amateur)


def _cd(alpha, tau=1.0):
    """The Li et al. (2023) score of each token, by hand."""
    e = torch.tensor(EXPERT).log().log_softmax(-1)
    a = (torch.tensor(AMATEUR).log() / tau).log_softmax(-1)
    keep = torch.tensor(EXPERT) >= alpha * max(EXPERT)
    return torch.where(keep, e - a, torch.tensor(float("-inf")))


def test_contrastive_scores_formula_and_plausibility_cut():
    expert = torch.tensor([EXPERT]).log()
    amateur = torch.tensor([AMATEUR]).log()
    for alpha in (0.0, 0.2, 0.5, 1.0):
        got = contrastive_scores(expert, amateur, torch.tensor([[alpha, 1.0]]))[0]
        assert torch.equal(torch.isinf(got), torch.isinf(_cd(alpha)))
        assert torch.allclose(got[torch.isfinite(got)], _cd(alpha)[torch.isfinite(got)])
    got = contrastive_scores(expert, amateur, torch.tensor([[0.2, 0.5]]))[0]
    assert torch.allclose(got[:3], _cd(0.2, 0.5)[:3]) and got[3] == float("-inf")
    # per-row parameters, and a [B, T, V] input
    rows = contrastive_scores(expert.expand(2, 3, -1), amateur.expand(2, 3, -1), torch.tensor([[0.0, 1.0], [0.5, 1.0]]))
    assert rows.shape == (2, 3, 4) and torch.isfinite(rows[0]).all() and torch.isinf(rows[1, :, 2:]).all()


@pytest.mark.parametrize(("alpha", "expected"), [(0.0, "d"), (0.2, "c"), (0.5, "b"), (1.0, "a")])
def test_greedy_contrastive_picks_the_formula_token_and_respects_the_cut(alpha, expected):
    # without the cut, "d" wins (expert 0.05 vs amateur ~0.001); alpha = 0.2 removes it, 0.5
    # leaves a and b, 1 leaves only the expert's argmax
    assert "abcd"[int(_cd(alpha).argmax())] == expected
    engine = _engine(_constant(EXPERT), _constant(AMATEUR))
    request = Request("a", SamplingParams(temperature=0, max_tokens=3), decoder=ContrastiveParams(alpha=alpha))
    out = engine.generate([request], ledger=Ledger())[0][0]
    assert out.text == expected * 3
    # logprobs keep their meaning: the expert model's own log-probability of each token
    token = "abcd".index(expected)
    expert = torch.tensor(EXPERT).log().log_softmax(-1)
    assert out.logprobs == pytest.approx([float(expert[token])] * 3, abs=1e-6)
    # the decoder's score of the token (log-softmax of the contrastive scores) is reported beside them
    assert out.decoder_logprobs == pytest.approx([float(_cd(alpha).log_softmax(-1)[token])] * 3, abs=1e-5)
    if expected != "a":  # where contrastive decoding departs from the expert, the two differ
        assert out.logprobs[0] != pytest.approx(out.decoder_logprobs[0], abs=1e-3)


def test_sampling_contrastive_draws_from_the_softmax_of_the_scores():
    engine = _engine(_constant(EXPERT), _constant(AMATEUR))
    n = 3000
    request = Request("a", SamplingParams(temperature=1.0, max_tokens=1, n=n, seed=7), decoder=ContrastiveParams(alpha=0.2))
    out = engine.generate([request], ledger=Ledger())[0]
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out]), minlength=4)
    assert_samples_match(counts, _cd(0.2).softmax(-1))


def test_batched_rows_with_different_alphas_and_lockstep_accounting():
    expert, amateur = MarkovModel.random(5, seed=1), MarkovModel.random(5, seed=2)
    engine = _engine(expert, amateur, vocab=5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    requests = [Request("ab", params, decoder=ContrastiveParams(alpha=0.0)),
                Request("cde", params, decoder=ContrastiveParams(alpha=0.3, amateur_temperature=0.5))]
    ledger = Ledger()
    together = engine.generate(requests, ledger=ledger)
    for request, outs in zip(requests, together, strict=True):
        assert outs[0].token_ids == engine.generate([request], ledger=Ledger())[0][0].token_ids
    # by hand: a Markov model's next token depends on the previous token only
    for request, outs in zip(requests, together, strict=True):
        prev = ord(request.prompt[-1]) - ord("a")
        spec = request.decoder
        for token in outs[0].token_ids:
            scores = contrastive_scores(expert.table[prev][None], amateur.table[prev][None],
                                        torch.tensor([[spec.alpha, spec.amateur_temperature]]))
            assert token == int(scores.argmax())
            prev = token
    u = ledger.usage
    # both models prefill, then 3 lockstep steps of both models
    assert u.forward_passes == 2 + 2 * 3
    assert u.flops == pytest.approx(2 * (expert.flops(0, 0, 2) + 3 * expert.flops(0, 0, 2)))
    assert (u.input_tokens, u.output_tokens) == (5, 8)


def test_cfg_scale_one_equals_plain_conditional_decoding():
    model = MarkovModel.random(6, seed=4)
    engine = _engine(model, vocab=6)
    for params in (SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.8, max_tokens=8, n=3, seed=11)):
        plain = engine.generate([Request("abc", params)], ledger=Ledger())[0]
        guided = engine.generate([Request("abc", params, decoder=GuidanceParams(scale=1.0, negative_prompt="f"))],
                                 ledger=Ledger())[0]
        assert [c.token_ids for c in guided] == [c.token_ids for c in plain]


def test_cfg_follows_the_guidance_formula_with_a_negative_prompt():
    model = MarkovModel.random(6, seed=9, sharpness=1.0)
    engine = _engine(model, vocab=6)
    scale = 2.5
    ledger = Ledger()
    out = engine.generate([Request("abc", SamplingParams(temperature=0, max_tokens=5),
                                   decoder=GuidanceParams(scale=scale, negative_prompt="ee"))], ledger=ledger)[0][0]
    cond, uncond = 2, 4  # last tokens of the prompt and of the negative prompt
    for token in out.token_ids:
        lp_c, lp_u = model.table[cond].log_softmax(-1), model.table[uncond].log_softmax(-1)
        assert token == int((lp_u + scale * (lp_c - lp_u)).argmax())
        cond = uncond = token  # both streams read the generated token
    assert ledger.usage.input_tokens == 3 + 2  # prompt and negative prompt


def test_cfg_default_unconditional_stream_is_the_last_prompt_token():
    model = MarkovModel.random(6, seed=3)
    engine = _engine(model, vocab=6)
    params = SamplingParams(temperature=0, max_tokens=6)
    # for a first-order Markov model the last token is all that matters: the streams agree,
    # so any scale decodes like plain greedy
    plain = engine.generate([Request("abc", params)], ledger=Ledger())[0][0]
    guided = engine.generate([Request("abc", params, decoder=GuidanceParams(scale=3.0))], ledger=Ledger())[0][0]
    assert guided.token_ids == plain.token_ids


def test_guidance_scores_formula():
    cond, uncond = torch.randn(2, 7), torch.randn(2, 7)
    got = guidance_scores(cond, uncond, torch.tensor([[1.0], [3.0]]))
    assert torch.allclose(got[0], cond[0].log_softmax(-1), atol=1e-6)
    want = uncond[1].log_softmax(-1) + 3.0 * (cond[1].log_softmax(-1) - uncond[1].log_softmax(-1))
    assert torch.allclose(got[1], want, atol=1e-6)


def test_pair_cache_forks_rows_with_their_parameters_and_truncates_both_streams():
    model = MarkovModel.random(4, seed=0)
    pair = LockstepPair(model, model, guidance_scores, [1.0])
    first, second = model.new_cache(2, 16), model.new_cache(2, 16)
    model.forward(torch.zeros(2, 5, dtype=torch.long), first)
    model.forward(torch.zeros(2, 2, dtype=torch.long), second)
    cache = PairCache(first, second, torch.tensor([[1.0], [2.0]]))
    pair.forward(torch.ones(2, 3, dtype=torch.long), cache)
    assert cache.lengths.tolist() == [8, 8] and cache.secondary.lengths.tolist() == [5, 5]
    forked = cache.fork([1, 1, 0])
    assert forked.params[:, 0].tolist() == [2.0, 2.0, 1.0] and forked.secondary.lengths.tolist() == [5, 5, 5]
    forked.truncate([6, 7, 8])
    assert forked.lengths.tolist() == [6, 7, 8] and forked.secondary.lengths.tolist() == [3, 4, 5]


def test_truncated_llama_shares_weights_and_full_depth_equals_the_model(smollm):
    model = smollm.model
    n = model.config.num_hidden_layers
    small = truncated_llama(model, 4)
    assert small.config.num_hidden_layers == 4 and small.embed.data_ptr() == model.embed.data_ptr()
    assert small.layers[3].qkv is model.layers[3].qkv  # the same weight objects, not copies
    tokens = torch.tensor([smollm.tokenizer.encode("The sky is")])
    full = truncated_llama(model, n).forward(tokens, model.new_cache(1, 8))
    assert torch.equal(full, model.forward(tokens, model.new_cache(1, 8)))
    assert not torch.allclose(small.forward(tokens, small.new_cache(1, 8)), full)
    for bad in (0, n + 1):
        with pytest.raises(InvalidParameter):
            truncated_llama(model, bad)


def test_contrastive_on_the_default_model_with_a_truncated_amateur(smollm):
    engine = LocalGenerator(smollm, amateur=truncated_llama(smollm.model, 8))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ledger = Ledger()
    out = engine.generate([Request("The capital of France is", params, decoder=ContrastiveParams(alpha=0.1))],
                          ledger=ledger)[0][0]
    assert len(out.token_ids) == 4 and all(math.isfinite(lp) for lp in out.logprobs)
    assert ledger.usage.forward_passes == 2 * 4  # prefill and 3 steps, each of both models
    # alpha = 1 keeps only the expert's argmax: contrastive decoding becomes plain greedy
    greedy = engine.generate([Request("The capital of France is", params)], ledger=Ledger())[0][0]
    top = engine.generate([Request("The capital of France is", params, decoder=ContrastiveParams(alpha=1.0))],
                          ledger=Ledger())[0][0]
    assert top.token_ids == greedy.token_ids


def test_cfg_scale_one_equals_plain_on_the_default_model(smollm_generator):
    request = Request.chat("Write one word about the sea.", SamplingParams(temperature=0, max_tokens=6))
    plain = smollm_generator.generate([request], ledger=Ledger())[0][0]
    guided = smollm_generator.generate([dataclasses.replace(request, decoder=GuidanceParams(scale=1.0))],
                                       ledger=Ledger())[0][0]
    assert guided.token_ids == plain.token_ids


@pytest.mark.parametrize(("build", "name"), [
    (lambda: ContrastiveParams(alpha=-0.1), "alpha"),
    (lambda: ContrastiveParams(alpha=1.5), "alpha"),
    (lambda: ContrastiveParams(alpha=float("nan")), "alpha"),
    (lambda: ContrastiveParams(amateur_temperature=0.0), "amateur_temperature"),
    (lambda: GuidanceParams(scale=-1.0), "cfg_scale"),
    (lambda: GuidanceParams(negative_prompt=""), "negative_prompt"),
])
def test_bad_parameters_are_typed_errors(build, name):
    with pytest.raises(InvalidParameter) as info:
        build()
    assert info.value.name == name


def test_amateur_with_a_different_vocabulary_is_a_typed_error():
    with pytest.raises(InvalidParameter, match="vocab"):
        _engine(MarkovModel.random(4), MarkovModel.random(5))
    with pytest.raises(InvalidParameter, match="vocab"):
        LockstepPair(MarkovModel.random(4), MarkovModel.random(5), contrastive_scores, [0.1, 1.0])


def test_contrastive_without_an_amateur_is_a_typed_error():
    engine = _engine(_constant(EXPERT))
    ledger = Ledger()
    with pytest.raises(Unsupported, match="contrastive"):
        engine.generate([Request("a", SamplingParams(max_tokens=2), decoder=ContrastiveParams())], ledger=ledger)
    assert ledger.usage.forward_passes == 0  # refused before any compute
    assert "contrastive" not in engine.capabilities.decoders


def test_streaming_contrastive_concatenates_to_the_generated_text():
    engine = _engine(_constant(EXPERT), _constant(AMATEUR))
    request = Request("a", SamplingParams(temperature=0, max_tokens=4), decoder=ContrastiveParams(alpha=0.2))
    chunks = list(engine.stream(request, ledger=Ledger()))
    assert "".join(c.text for c in chunks) == engine.generate([request], ledger=Ledger())[0][0].text == "cccc"
