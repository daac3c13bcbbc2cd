"""The k most likely tokens at each position (`SamplingParams.top_logprobs`) and the prompt's own
log-probabilities (`LocalGenerator.prompt_logprobs`): exact against a Markov table whose
distribution after each token is known, the same through every decoder (plain, speculative, beam,
streaming), and on the real model equal to an uncached forward over the finished text."""

import pytest
import torch

from metaloom.decode.specs import BeamParams
from metaloom.errors import InvalidParameter, Unsupported
from metaloom.generator import LocalGenerator, Request, TokenIds
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.speculative import Speculative
from metaloom.speculative.drafters.ngram import NgramDrafter
from metaloom.testing.scripted import ScriptedGenerator
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

V = 7


def _toy(speculative=None, seed=3):
    model = MarkovModel.random(V, seed=seed)
    loaded = LoadedModel(model=model, tokenizer=CharTokenizer(V), name="toy", folder="", dtype=torch.float32)
    return LocalGenerator(loaded, speculative=speculative)


def _expected(table: torch.Tensor, after: list[int], k: int) -> list[list[tuple[int, float]]]:
    """The k most likely tokens after each token of ``after`` (a Markov chain: only the last token counts)."""
    lp = torch.log_softmax(table.float(), dim=-1)
    out = []
    for t in after:
        values, ids = lp[t].topk(k)
        out.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
    return out


def _check(got, expected) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert [t for t, _ in g] == [t for t, _ in e]
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in e], abs=1e-6)


def test_each_sampled_position_reports_the_tables_k_most_likely_tokens_and_each_row_its_own_k():
    gen = _toy()
    table = gen.model.table
    requests = [Request("ab", SamplingParams(temperature=1.0, seed=s, max_tokens=8, top_logprobs=k))
                for s, k in ((1, 3), (2, 0), (3, V))]
    out = [c[0] for c in gen.generate(requests, ledger=Ledger())]
    for c, k in zip(out, (3, 0, V), strict=True):
        if k == 0:
            assert c.top_logprobs is None
            continue
        before = [1, *c.token_ids[:-1]]  # "ab": the first token follows b = 1
        _check(c.top_logprobs, _expected(table, before, k))
        for i, t in enumerate(c.token_ids):  # the chosen token's entry is its reported log-probability
            entry = dict(c.top_logprobs[i])
            if t in entry:
                assert entry[t] == pytest.approx(c.logprobs[i], abs=1e-6)
    assert len(out[2].top_logprobs[0]) == V and all(t in dict(top) for t, top in zip(out[2].token_ids, out[2].top_logprobs,
                                                                                     strict=True))


def test_streamed_chunks_carry_the_same_top_tokens_as_generate():
    gen = _toy()
    request = Request("ca", SamplingParams(temperature=0.8, seed=7, max_tokens=10, top_logprobs=2, n=2))
    whole = gen.generate([request], ledger=Ledger())[0]
    joined: dict[int, list] = {0: [], 1: []}
    for chunk in gen.stream(request, ledger=Ledger()):
        assert len(chunk.top_logprobs) == len(chunk.token_ids)
        joined[chunk.index] += list(chunk.top_logprobs)
    assert [tuple(joined[i]) for i in (0, 1)] == [c.top_logprobs for c in whole]


def test_speculative_decoding_reports_the_same_top_tokens_as_plain_decoding():
    plain = _toy()
    fast = _toy(Speculative(NgramDrafter(), num_draft=3))
    request = Request("abcabcab", SamplingParams(temperature=0, max_tokens=12, top_logprobs=4))
    a = plain.generate([request], ledger=Ledger())[0][0]
    ledger = Ledger()
    b = fast.generate([request], ledger=ledger)[0][0]
    assert ledger.usage.drafted_tokens > 0  # drafts were verified, so the multi-position path ran
    assert a.token_ids == b.token_ids
    _check(b.top_logprobs, a.top_logprobs)


def test_beam_hypotheses_report_the_top_tokens_after_their_own_prefix():
    gen = _toy()
    table = gen.model.table
    out = gen.generate([Request("b", SamplingParams(max_tokens=5, top_logprobs=3, n=3), decoder=BeamParams(beams=3))],
                       ledger=Ledger())[0]
    assert len(out) == 3
    for c in out:
        _check(c.top_logprobs, _expected(table, [1, *c.token_ids[:-1]], 3))


def test_prompt_logprobs_are_exact_rank_included_and_do_not_depend_on_the_chunk_size():
    gen = _toy()
    table = gen.model.table
    prompt = TokenIds((0, 3, 5, 1, 1, 6, 2, 4, 0))
    ids, positions = gen.prompt_logprobs(prompt, 2, ledger=Ledger())
    assert ids == list(prompt.ids) and len(positions) == len(ids) - 1
    lp = torch.log_softmax(table, dim=-1)
    for i, p in enumerate(positions):
        before, token = ids[i], ids[i + 1]
        assert p.token == token and p.logprob == pytest.approx(float(lp[before, token]), abs=1e-6)
        assert p.rank == 1 + int((lp[before] > lp[before, token]).sum())
        _check([p.top], _expected(table, [before], 2))
    from metaloom.decode.score import prompt_logprobs
    ledger = Ledger()
    small = prompt_logprobs(gen.model, ids, 2, ledger, chunk=3)
    assert small == positions
    assert ledger.usage.forward_passes == 3 and ledger.usage.input_tokens == len(ids)  # 8 scored positions, 3 a forward
    quiet = Ledger()
    prompt_logprobs(gen.model, ids, 0, quiet, count_input=False)
    assert quiet.usage.input_tokens == 0 and quiet.usage.forward_passes == 1


def test_bad_counts_are_typed_errors_and_a_generator_that_cannot_report_them_says_so():
    with pytest.raises(InvalidParameter, match="top_logprobs"):
        SamplingParams(top_logprobs=-1)
    with pytest.raises(InvalidParameter, match="top_logprobs"):
        _toy().generate([Request("a", SamplingParams(top_logprobs=V + 1))], ledger=Ledger())
    with pytest.raises(Unsupported, match="top_logprobs"):
        ScriptedGenerator({"a": ["b"]}).generate([Request("a", SamplingParams(top_logprobs=2))], ledger=Ledger())


@pytest.mark.model
def test_real_model_top_tokens_equal_an_uncached_forward_over_the_finished_text(smollm_generator):
    """Cached decoding vs one uncached pass over prompt + output (`prompt_logprobs`): the same
    top tokens and values at every generated position."""
    gen = smollm_generator
    request = Request(TokenIds(tuple(gen.tokenizer.encode("The three primary colours are"))),
                      SamplingParams(temperature=0, max_tokens=12, top_logprobs=5))
    c = gen.generate([request], ledger=Ledger())[0][0]
    _, positions = gen.prompt_logprobs(TokenIds(request.prompt.ids + c.token_ids), 5, ledger=Ledger())
    tail = positions[len(request.prompt.ids) - 1:]
    assert [p.token for p in tail] == list(c.token_ids)
    assert [p.logprob for p in tail] == pytest.approx(list(c.logprobs), abs=2e-3)
    for p, top in zip(tail, c.top_logprobs, strict=True):
        assert top[0][0] == p.top[0][0]  # greedy: the chosen token is the most likely one
        assert [lp for _, lp in top] == pytest.approx([lp for _, lp in p.top], abs=2e-3)
