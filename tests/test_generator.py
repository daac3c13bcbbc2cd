"""The local generator: exactness against transformers, determinism, batching, accounting."""

import pytest
import torch

from metaloom.decode.rows import RowState
from metaloom.errors import ContextWindowExceeded
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Budget, Ledger
from metaloom.models.flops import attended_keys, forward_flops
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
           "List three prime numbers.", "Explain what a neural network is in one sentence."]


def _toy_generator(vocab=6, eos=None, seed=0):
    model = MarkovModel.random(vocab, seed=seed)
    return LocalGenerator(LoadedModel(model=model, tokenizer=CharTokenizer(vocab, eos), name="toy", folder="",
                                      dtype=torch.float32))


def test_greedy_equals_transformers_token_for_token(smollm, smollm_generator, hf_smollm):
    tok = smollm.tokenizer
    for prompt in PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
        out = smollm_generator.generate([Request.chat(prompt, SamplingParams(temperature=0, max_tokens=24))],
                                        ledger=Ledger())[0][0]
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = hf_smollm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                                     eos_token_id=sorted(tok.eos_token_ids), pad_token_id=0)
        assert list(out.token_ids) == ref[0, len(ids):].tolist(), prompt


def test_batched_requests_of_different_lengths_equal_each_alone(smollm_generator):
    reqs = [Request.chat(p, SamplingParams(temperature=0, max_tokens=12)) for p in PROMPTS]
    together = smollm_generator.generate(reqs, ledger=Ledger())
    for req, outs in zip(reqs, together, strict=True):
        alone = smollm_generator.generate([req], ledger=Ledger())[0][0]
        assert outs[0].token_ids == alone.token_ids


def test_same_seed_same_output_and_forked_rows_differ(smollm_generator):
    params = SamplingParams(temperature=1.0, n=4, seed=123, max_tokens=16)
    a = smollm_generator.generate([Request.chat("Tell me a story.", params)], ledger=Ledger())[0]
    b = smollm_generator.generate([Request.chat("Tell me a story.", params)], ledger=Ledger())[0]
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({c.token_ids for c in a}) > 1


def test_n_samples_charge_the_prompt_once_and_flops_follow_the_formula(smollm, smollm_generator):
    params = SamplingParams(temperature=1.0, n=3, seed=0, max_tokens=5, ignore_eos=True)
    request = Request("The weather today is", params)
    prompt_len = len(smollm.tokenizer.encode("The weather today is"))
    ledger = Ledger()
    out = smollm_generator.generate([request], ledger=ledger)[0]
    assert [len(c.token_ids) for c in out] == [5, 5, 5]
    u = ledger.usage
    assert (u.input_tokens, u.cached_tokens, u.output_tokens, u.forward_passes) == (prompt_len, 0, 15, 5)
    c = smollm.model.config
    shape = dict(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                 kv_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate=c.intermediate_size,
                 vocab=c.vocab_size)
    # prefill once (logits for the last token only), then 4 decode steps of 3 rows
    expected = forward_flops(**shape, new_tokens=prompt_len, attended=attended_keys([0], [prompt_len]), logit_rows=1)
    for step in range(4):
        length = prompt_len + step
        expected += forward_flops(**shape, new_tokens=3, attended=attended_keys([length] * 3, [1] * 3), logit_rows=3)
    assert u.flops == pytest.approx(expected)
    assert u.seconds > 0
    assert all(len(comp.logprobs) == 5 and all(lp <= 0 for lp in comp.logprobs) for comp in out)


def test_streaming_concatenates_to_the_generated_text(smollm_generator):
    params = SamplingParams(temperature=0, max_tokens=30)
    req = Request.chat("Describe the ocean.", params)
    chunks = list(smollm_generator.stream(req, ledger=Ledger()))
    full = smollm_generator.generate([req], ledger=Ledger())[0][0]
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].finish_reason == full.finish_reason
    assert sum(len(c.token_ids) for c in chunks) == len(full.token_ids)


def test_stop_string_cuts_the_text(smollm_generator):
    params = SamplingParams(temperature=0, max_tokens=40, stop=("Paris",))
    out = smollm_generator.generate([Request.chat("What is the capital of France?", params)], ledger=Ledger())[0][0]
    assert out.finish_reason == "stop" and "Paris" not in out.text


def test_prompt_longer_than_context_is_a_typed_error_before_compute(smollm_generator):
    ledger = Ledger()
    with pytest.raises(ContextWindowExceeded, match="context window is 8192"):
        smollm_generator.generate([Request("word " * 9000, SamplingParams(max_tokens=4))], ledger=ledger)
    assert ledger.usage.forward_passes == 0


def test_a_budget_reached_mid_generation_keeps_the_tokens_so_far():
    from metaloom.errors import BudgetExceeded

    gen = _toy_generator()
    ledger = Ledger(budget=Budget(forward_passes=3))
    out = gen.generate([Request("abc", SamplingParams(temperature=0, max_tokens=50, n=2))], ledger=ledger)[0]
    # the prefill and three steps ran (the third passed the limit): the token each forward
    # gave is kept, and the rows say why they stopped
    assert [(len(c.token_ids), c.finish_reason) for c in out] == [(4, "budget"), (4, "budget")]
    whole = gen.generate([Request("abc", SamplingParams(temperature=0, max_tokens=50))], ledger=Ledger())[0][0]
    assert out[0].token_ids == whole.token_ids[:4]
    assert ledger.usage.forward_passes == 4 and ledger.usage.output_tokens == 8  # the passing step is reported
    with pytest.raises(BudgetExceeded, match="forward_passes"):
        ledger.check()  # the ledger stays over its budget: the next call's first charge stops it
    again = gen.generate([Request("abc", SamplingParams(temperature=0, max_tokens=5))], ledger=ledger)[0][0]
    assert (again.token_ids, again.finish_reason) == ((), "budget")
    assert ledger.usage.forward_passes == 4  # nothing more was computed


def test_toy_greedy_follows_the_markov_table():
    gen = _toy_generator(vocab=6)
    table = gen.model.table
    out = gen.generate([Request("ab", SamplingParams(temperature=0, max_tokens=6))], ledger=Ledger())[0][0]
    expected, last = [], 1
    for _ in range(6):
        last = int(table[last].argmax())
        expected.append(last)
    assert list(out.token_ids) == expected


def test_toy_eos_and_max_tokens_finish_reasons():
    vocab = 4
    table = torch.full((vocab, vocab), -10.0)
    table[0, 1] = table[1, 2] = table[2, 3] = 10.0  # a -> b -> c -> eos(d)
    gen = LocalGenerator(LoadedModel(model=MarkovModel(table), tokenizer=CharTokenizer(vocab, eos=3), name="toy",
                                     folder="", dtype=torch.float32))
    done = gen.generate([Request("a", SamplingParams(temperature=0, max_tokens=10)),
                         Request("a", SamplingParams(temperature=0, max_tokens=1))], ledger=Ledger())
    assert (done[0][0].text, done[0][0].finish_reason, done[0][0].token_ids) == ("bc", "stop", (1, 2, 3))
    assert (done[1][0].text, done[1][0].finish_reason) == ("b", "length")


def test_streaming_n_samples_interleaves_chunks_that_say_whose_they_are():
    gen = _toy_generator()
    request = Request("a", SamplingParams(n=3, seed=4, max_tokens=7, temperature=1.0))
    chunks = list(gen.stream(request, ledger=Ledger()))
    alone = gen.generate([request], ledger=Ledger())[0]
    assert {c.index for c in chunks} == {0, 1, 2}
    for i, completion in enumerate(alone):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text for c in mine) == completion.text
        assert sum((c.token_ids for c in mine), ()) == completion.token_ids
        assert sum((c.logprobs for c in mine), ()) == pytest.approx(completion.logprobs)
        assert [c.finish_reason for c in mine][-1] == completion.finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])


def test_row_state_streaming_holds_back_partial_stop_strings():
    tok = CharTokenizer(26)
    row = RowState.start(tok, 20, stop=("cde",))
    shown = []
    for ch in "abcdx":
        row.append(ord(ch) - 97, 0.0)
        shown.append(row.pending_text())
    assert shown == ["a", "b", "", "", "cdx"]
    row = RowState.start(tok, 20, stop=("cde",))
    for ch in "abcde":
        row.append(ord(ch) - 97, 0.0)
    # nothing was streamed yet: the text before the stop string is released, the stop string never
    assert (row.text, row.finish_reason, row.pending_text(), row.pending_text()) == ("ab", "stop", "ab", "")
