"""The engine core: rows joining and leaving one decode loop, exact continuation, stop
reasons, rows that cannot go on, forks that share keys, honest state (RNG, threads)."""

import threading

import pytest
import torch

from metaloom.errors import ContextWindowExceeded, InvalidParameter, Unsupported
from metaloom.generator import LocalGenerator, Request, TokenIds
from metaloom.ledger import Budget, Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.testing.scripted import ScriptedGenerator
from metaloom.testing.tiny import tiny_llama
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.", "List three prime numbers."]


def _toy(vocab=6, eos=None, seed=0):
    model = MarkovModel.random(vocab, seed=seed)
    return LocalGenerator(LoadedModel(model=model, tokenizer=CharTokenizer(vocab, eos), name="toy", folder="",
                                      dtype=torch.float32))


def _drain(batch):
    while batch.rows:
        batch.step()


# --- rows join and leave ----------------------------------------------------------------------

@pytest.mark.model
def test_rows_admitted_mid_flight_give_exactly_the_tokens_they_give_alone(smollm_generator):
    gen = smollm_generator
    greedy = SamplingParams(temperature=0, max_tokens=14)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, n=2, seed=11, max_tokens=10)
    requests = [Request.chat(PROMPTS[0], greedy), Request.chat(PROMPTS[1], sampled), Request.chat(PROMPTS[2], greedy)]
    alone = [gen.generate([r], ledger=Ledger())[0] for r in requests]
    batch = gen.new_batch()
    first = batch.admit(gen.rows_for(requests[0], Ledger()))
    for _ in range(3):
        batch.step()
    second = batch.admit(gen.rows_for(requests[1], Ledger()))  # joins a running batch, at other lengths
    batch.step()
    third = batch.admit(gen.rows_for(requests[2], Ledger()))
    assert len(batch.rows) == 4
    _drain(batch)
    got = [[r.state.tokens for r in rows] for rows in (first, second, third)]
    assert got == [[list(c.token_ids) for c in a] for a in alone]
    assert gen.pool.used_slots == 0  # every row left and freed its keys and values


def test_finished_rows_leave_and_free_their_slots_at_once(tmp_path):
    gen = LocalGenerator(tiny_llama())
    batch = gen.new_batch()
    rows = batch.admit(gen.rows_for(Request("abcd", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)),
                                    Ledger()) + gen.rows_for(Request("abcd", SamplingParams(temperature=0, max_tokens=6,
                                                                                             ignore_eos=True)), Ledger()))
    batch.step()  # the first row has its 2 tokens: it leaves
    assert [r.state.done for r in rows] == [True, False] and len(batch.rows) == 1
    assert gen.pool.used_slots == 4 + 1  # the live row's prompt and its one fed token; nothing of the first
    _drain(batch)
    assert gen.pool.used_slots == 0


def test_cancelling_a_stream_frees_the_rows():
    gen = LocalGenerator(tiny_llama())
    ledger = Ledger()
    stream = gen.stream(Request("abc", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=50, ignore_eos=True)),
                        ledger=ledger)
    for _ in range(7):
        next(stream)
    assert gen.pool.used_slots > 0
    stream.close()
    assert gen.pool.used_slots == 0 and ledger.usage.output_tokens < 3 * 50


# --- exact continuation and stop reasons -------------------------------------------------------

@pytest.mark.model
def test_a_branch_continues_exactly_where_its_parent_stopped(smollm_generator):
    gen = smollm_generator
    prompt = Request.chat(PROMPTS[2]).prompt
    whole = gen.generate([Request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))],
                         ledger=Ledger())[0][0]
    parent = gen.generate([Request(prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))],
                          ledger=Ledger())[0][0]
    child = gen.generate([Request(prompt, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True),
                                  prefix=parent.token_ids)], ledger=Ledger())[0][0]
    assert parent.token_ids + child.token_ids == whole.token_ids
    assert parent.text + child.text == whole.text  # text continues too (the prefix is the detokeniser's context)
    # the same from the prompt as token ids (no template, no encoding)
    ids = gen.tokenizer.encode(gen.render(prompt), add_special_tokens=False)
    again = gen.generate([Request(TokenIds(tuple(ids)), SamplingParams(temperature=0, max_tokens=15, ignore_eos=True),
                                  prefix=parent.token_ids)], ledger=Ledger())[0][0]
    assert again.token_ids == child.token_ids


def test_stop_reasons_and_keeping_the_stop_string():
    g = _toy(vocab=4, eos=None)
    table = torch.full((4, 4), -10.0)
    table[0, 1] = table[1, 2] = table[2, 0] = table[3, 3] = 10.0  # a -> b -> c -> a ...
    g = LocalGenerator(LoadedModel(model=MarkovModel(table), tokenizer=CharTokenizer(4, eos=3), name="toy", folder="",
                                   dtype=torch.float32))
    cut = g.generate([Request("a", SamplingParams(temperature=0, max_tokens=20, stop=("ca", "zz")))], ledger=Ledger())[0][0]
    assert (cut.text, cut.token_ids, cut.finish_reason, cut.stop_reason) == ("b", (1, 2, 0), "stop", "ca")
    kept = g.generate([Request("a", SamplingParams(temperature=0, max_tokens=20, stop=("ca",),
                                                   include_stop_str_in_output=True))], ledger=Ledger())[0][0]
    assert (kept.text, kept.token_ids, kept.stop_reason) == ("bca", (1, 2, 0), "ca")
    length = g.generate([Request("a", SamplingParams(temperature=0, max_tokens=2))], ledger=Ledger())[0][0]
    assert (length.finish_reason, length.stop_reason) == ("length", None)
    table[2, 3], table[2, 0] = 10.0, -10.0  # ... c -> end of sequence
    eos = g.generate([Request("a", SamplingParams(temperature=0, max_tokens=20))], ledger=Ledger())[0][0]
    assert (eos.text, eos.finish_reason, eos.stop_reason) == ("bc", "stop", 3)


# --- rows that cannot go on; bad requests -----------------------------------------------------

@pytest.mark.model
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_whose_every_token_is_banned_ends_with_a_reason_and_spares_the_others(smollm_generator, temperature):
    from metaloom.constrain import ConstraintSpec

    gen = smollm_generator
    banned = Request("Repeat: abababab", SamplingParams(temperature=temperature, seed=1, max_tokens=20,
                                                      no_repeat_ngram_size=1), constraint=ConstraintSpec.regex("(ab){8}"))
    fine = Request("Repeat: abababab", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    out = gen.generate([banned, fine], ledger=Ledger())
    (dead,), (alive,) = out
    assert dead.finish_reason == "error" and "constraint allows" in dead.error and "no_repeat_ngram_size" in dead.error
    assert alive.token_ids == gen.generate([fine], ledger=Ledger())[0][0].token_ids


def test_bad_requests_are_typed_errors_before_any_compute():
    g = _toy(vocab=6)
    ledger = Ledger()
    for request, error, name in [
        (Request(TokenIds((1, 2, 99))), InvalidParameter, "prompt ids"),
        (Request("abc", prefix=(1, 77)), InvalidParameter, "prefix"),
        (Request("abc", SamplingParams(max_tokens=2000)), ContextWindowExceeded, None),
    ]:
        with pytest.raises(error) as info:
            g.generate([Request("ab"), request], ledger=ledger)
        if name is not None:
            assert info.value.name == name
    with pytest.raises(InvalidParameter, match="token_healing"):
        Request("abc", token_healing=True, prefix=(1,))
    assert ledger.usage.forward_passes == 0 and ledger.usage.input_tokens == 0


def test_a_generator_refuses_what_it_cannot_do_naming_the_field():
    from metaloom.constrain import ConstraintSpec
    from metaloom.decode.specs import BeamParams

    g = ScriptedGenerator({"q": ["a"]})
    for request, field in [(Request("q", constraint=ConstraintSpec.regex("a")), "constraint regex"),
                           (Request("q", decoder=BeamParams()), "decoder beam"),
                           (Request("q", token_healing=True), "token_healing")]:
        with pytest.raises(Unsupported) as info:
            g.generate([request], ledger=Ledger())
        assert info.value.field == field
    assert g.requests == []


# --- forks share keys and values; honest state -------------------------------------------------

def test_forking_many_branches_copies_no_keys():
    gen = LocalGenerator(tiny_llama())
    prompt = "abcdefghij" * 20  # 200 tokens
    batch = gen.new_batch()
    rows = batch.admit(gen.rows_for(Request(prompt, SamplingParams(n=64, temperature=1.0, seed=3, max_tokens=10,
                                                                   ignore_eos=True)), Ledger()))
    assert len(rows) == 64 and gen.pool.used_slots == 200  # one prompt's keys for 64 rows
    for _ in range(7):
        batch.step()
    assert gen.pool.used_slots == 200 + 64 * 7  # plus each row's own new tokens
    _drain(batch)
    assert gen.pool.used_slots == 0


def test_unseeded_sampling_leaves_torch_global_generator_alone():
    g = _toy()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    outs = [g.generate([Request("ab", SamplingParams(temperature=1.0, max_tokens=12))], ledger=Ledger())[0][0]
            for _ in range(4)]
    assert torch.equal(torch.get_rng_state(), before)
    assert len({c.token_ids for c in outs}) > 1  # still random: seeded from the OS


def test_a_ledger_charged_from_many_threads_loses_nothing():
    parent = Ledger(budget=Budget(output_tokens=10**9))
    children = [parent.child() for _ in range(4)]

    def charge(ledger):
        for _ in range(2000):
            ledger.charge(output_tokens=1, flops=0.5)

    threads = [threading.Thread(target=charge, args=(c,)) for c in children for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert parent.usage.output_tokens == 8 * 2000 and parent.usage.flops == 8 * 1000
    assert [c.usage.output_tokens for c in children] == [4000] * 4


def test_meta_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, metaloom.meta, metaloom.score.judge, metaloom.generator; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_joined_samplers_process_exactly_like_one_built_at_once():
    from metaloom.sampling.pipeline import make_sampler

    vocab = 40
    a = [SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3, logit_bias={3: -2.0}),
         SamplingParams(temperature=0)]
    b = [SamplingParams(temperature=1.1, min_p=0.1, presence_penalty=0.5, dry_multiplier=0.8,
                        dry_sequence_breakers=(), no_repeat_ngram_size=2),
         SamplingParams(temperature=0.9, mirostat=2, top_p=0.9)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    outputs = [[], [1, 2], [4, 4, 4], [7]]
    whole = make_sampler(a + b, vocab)
    state = whole.start(prompts, outputs)
    sa, sb = make_sampler(a, vocab), make_sampler(b, vocab)
    joined = sa.join(sb)
    joined_state = sa.start(prompts[:2], outputs[:2]).join(sb.start(prompts[2:], outputs[2:]), 2, 2)
    logits = torch.randn(4, vocab, generator=g)
    for _ in range(3):
        want = whole.process(logits, state)
        got = joined.process(logits, joined_state)
        assert torch.allclose(got, want, equal_nan=True)
        tokens = want.argmax(-1)
        state, joined_state = whole.advance(state, tokens, want), joined.advance(joined_state, tokens, got)
        logits = torch.randn(4, vocab, generator=g)


@pytest.mark.model
def test_score_reads_the_log_probabilities_generation_reports(smollm_generator):
    gen = smollm_generator
    prompt = Request.chat("Name a colour.").prompt
    out = gen.generate([Request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))],
                       ledger=Ledger())[0][0]
    ledger = Ledger()
    scored = gen.score(prompt, [TokenIds(out.token_ids), out.text], ledger=ledger)
    assert scored[0].token_ids == out.token_ids
    assert scored[0].logprobs == pytest.approx(out.logprobs, abs=2e-4)  # one forward vs six steps: rounding only
    assert scored[1].token_ids == out.token_ids  # the text re-encodes to the same tokens here
    assert ledger.usage.forward_passes == 2  # the prompt once, both continuations in one batched forward
    assert gen.render(prompt).endswith("assistant\n") and "Name a colour." in gen.render(prompt)


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_speculative_rows_admitted_mid_flight_equal_plain_greedy(drafter):
    from metaloom.speculative import Speculative
    from metaloom.speculative.drafters.draft_model import DraftModelDrafter
    from metaloom.speculative.drafters.ngram import NgramDrafter
    loaded = tiny_llama()
    chosen = NgramDrafter() if drafter == "ngram" else DraftModelDrafter(loaded.model)  # itself: every draft kept
    gen = LocalGenerator(loaded, speculative=Speculative(chosen, num_draft=3))
    plain = LocalGenerator(loaded)
    requests = [Request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for p, n in (("abcabcabc", 20), ("xyzxyz", 12), ("hello", 16))]
    alone = [plain.generate([r], ledger=Ledger())[0][0].token_ids for r in requests]
    ledger = Ledger()
    batch = gen.new_batch()
    handles = [batch.admit(gen.rows_for(requests[0], ledger))]
    batch.step()
    handles.append(batch.admit(gen.rows_for(requests[1], ledger)))
    batch.step()
    handles.append(batch.admit(gen.rows_for(requests[2], ledger)))
    _drain(batch)
    assert [tuple(rows[0].state.tokens) for rows in handles] == alone
    assert ledger.usage.drafted_tokens > 0 and ledger.usage.verify_steps > 0
    if drafter == "draft":
        assert ledger.usage.accepted_tokens == ledger.usage.drafted_tokens
