"""The pipeline with every adapter: parameters, per-row state, order, the CLI flags, and a
smoke test on the real model."""

import math

import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.sampling import SamplingParams, SamplingState, make_sampler

INF = float("-inf")


@pytest.mark.parametrize(("field", "value"), [
    ("dynatemp_range", -0.1), ("dynatemp_range", 1.5), ("dynatemp_exponent", 0.0), ("typical_p", 0.0),
    ("typical_p", 1.1), ("epsilon_cutoff", 1.0), ("eta_cutoff", -0.1), ("top_h", 1.5), ("top_n_sigma", -1.0),
    ("xtc_probability", 1.5), ("xtc_threshold", 0.0), ("xtc_threshold", 0.6), ("mirostat", 1), ("mirostat", True),
    ("mirostat_tau", 0.0), ("mirostat_eta", -0.1), ("dry_multiplier", -1.0), ("dry_base", 0.5),
    ("dry_allowed_length", 0), ("dry_penalty_last_n", 0), ("dry_sequence_breakers", "\n"),
    ("dry_sequence_breakers", ("",)), ("no_repeat_ngram_size", -1), ("no_repeat_ngram_size", 2.0),
    ("top_n_sigma", float("inf")),
])
def test_invalid_adapter_parameters_name_the_parameter(field, value):
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(**{field: value})
    assert info.value.name == field and "allowed" in str(info.value)


def test_dynatemp_range_cannot_reach_below_zero_or_apply_to_greedy():
    SamplingParams(temperature=1.0, dynatemp_range=1.0)
    with pytest.raises(InvalidParameter, match="dynatemp_range"):
        SamplingParams(temperature=0.0, dynatemp_range=0.5)


def test_from_openai_maps_llama_cpp_and_transformers_names():
    body = {"temperature": 0.9, "top_n_sigma": 1.5, "typical_p": 0.9, "epsilon_cutoff": 3e-4, "eta_cutoff": 2e-3,
            "top_h": 0.4, "dynatemp_range": 0.3, "dynatemp_exponent": 1.5, "mirostat": 2, "mirostat_tau": 4.0,
            "mirostat_eta": 0.2, "xtc_probability": 0.5, "xtc_threshold": 0.2, "dry_multiplier": 0.8, "dry_base": 1.5,
            "dry_allowed_length": 3, "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\n", "."],
            "no_repeat_ngram_size": 3, "repetition_penalty": 1.1, "min_p": 0.05, "top_k": 40, "model": "x"}
    p = SamplingParams.from_openai(body)
    for key, value in body.items():
        if key not in ("model", "dry_sequence_breakers"):
            assert getattr(p, key) == value, key
    assert p.dry_sequence_breakers == ("\n", ".")
    with pytest.raises(InvalidParameter, match="mirostat"):
        SamplingParams.from_openai({"mirostat": 1})


def test_adapters_lists_what_acts_and_greedy_rows_skip_sampling_steps():
    assert SamplingParams().adapters == frozenset()
    p = SamplingParams(top_k=5, xtc_probability=0.5, dry_multiplier=1.0, mirostat=2)
    assert p.adapters == {"top_k", "xtc", "dry", "mirostat"}
    assert SamplingParams(temperature=0, top_k=5, mirostat=2, dry_multiplier=1.0).adapters == {"dry"}


def test_state_holds_only_what_the_batch_needs():
    s = make_sampler([SamplingParams()], 10).start([[1, 2]])
    assert (s.seen, s.counts, s.history, s.lengths, s.mu) == (None, None, None, None, None)
    s = make_sampler([SamplingParams(repetition_penalty=1.2, no_repeat_ngram_size=2),
                      SamplingParams(presence_penalty=0.5, mirostat=2, mirostat_tau=3.0)], 10).start([[1, 2, 2], [4]])
    assert s.seen is not None and s.seen.nonzero().tolist() == [[0, 1], [0, 2], [1, 4]]
    assert s.counts is not None and int(s.counts.sum()) == 0  # presence/frequency count output only
    assert s.history is not None and s.history.tolist() == [[1, 2, 2], [4, -1, -1]]
    assert s.lengths is not None and s.lengths.tolist() == [3, 1]
    assert s.mu is not None and s.mu.tolist() == [10.0, 6.0]  # 2 * tau, as llama.cpp starts


def test_advance_returns_a_new_state_and_select_reorders_it():
    sampler = make_sampler([SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, dry_multiplier=0.5)] * 2, 6,
                           encode=lambda s: [5])
    s0 = sampler.start([[1], [2, 3]])
    lp = sampler.process(torch.zeros(2, 6), s0)
    s1 = sampler.advance(s0, torch.tensor([4, 0]), lp)
    assert s0.history is not None and s0.history.tolist() == [[1, -1], [2, 3]]  # untouched
    assert s1.history is not None and s1.history.tolist() == [[1, 4, -1], [2, 3, 0]]
    assert s1.lengths is not None and s1.lengths.tolist() == [2, 3]
    assert s1.counts is not None and s1.counts.nonzero().tolist() == [[0, 4], [1, 0]]
    assert s1.seen is not None and s1.seen.nonzero().tolist() == [[0, 1], [0, 4], [1, 0], [1, 2], [1, 3]]
    s2 = s1.select([1])
    assert s2.history is not None and s2.history.tolist() == [[2, 3, 0]]
    assert sampler.select([1]).params == (sampler.params[1],)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(mirostat=2), SamplingParams(presence_penalty=0.5),
                                    SamplingParams(repetition_penalty=1.1), SamplingParams(no_repeat_ngram_size=2)])
def test_a_state_that_keeps_nothing_advances_to_itself_and_one_that_keeps_something_moves(params):
    sampler = make_sampler([params], 6)
    s0 = sampler.start([[1, 2]])
    s1 = sampler.advance(s0, torch.tensor([4]), sampler.process(torch.zeros(1, 6), s0))
    keeps = any(getattr(s0, f) is not None for f in ("seen", "counts", "history", "lengths", "mu"))
    assert s0.empty is not keeps
    assert (s1 is s0) is not keeps  # an empty state is shared (frozen); a kept one is a new state


def test_stateful_adapters_without_state_say_how_to_build_it():
    sampler = make_sampler([SamplingParams(no_repeat_ngram_size=2)], 5)
    with pytest.raises(ValueError, match="start"):
        sampler.process(torch.zeros(1, 5))


def test_dry_breakers_come_from_the_tokenizer():
    p = SamplingParams(dry_multiplier=1.0)
    with pytest.raises(InvalidParameter, match="dry_sequence_breakers"):
        make_sampler([p], 10)
    sampler = make_sampler([p], 10, encode=lambda text: {"\n": [7], ":": [8], "\"": [3, 9], "*": []}[text])
    assert sampler.breakers is not None and sampler.breakers[0].nonzero().flatten().tolist() == [7, 8, 9]
    make_sampler([SamplingParams(dry_multiplier=1.0, dry_sequence_breakers=())], 10)  # no breakers: no tokenizer needed


def test_greedy_rows_get_penalties_but_skip_sampling_steps():
    # DRY bans the continuation of "1 2 | 1 2" for the greedy row; top-k 1 and XTC would act on a sampled row
    params = [SamplingParams(temperature=0, dry_multiplier=100.0, dry_sequence_breakers=(), top_k=1, xtc_probability=1.0)]
    sampler = make_sampler(params, 4)
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0]])
    lp = sampler.process(logits, sampler.start([[1, 2, 3, 1, 2]]))
    assert sampler.draw(lp, torch.rand(1, dtype=torch.float64)).tolist() == [0]  # 3 penalised away; argmax of the rest
    assert bool(torch.isfinite(lp).all())


def test_mixed_batch_rows_are_independent():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.7), SamplingParams(top_p=0.5, typical_p=0.5, top_n_sigma=1.0, xtc_probability=1.0),
              SamplingParams(mirostat=2, top_h=0.5, dynatemp_range=0.5)]
    sampler = make_sampler(params, 20)
    lp = sampler.process(logits, sampler.start())
    torch.testing.assert_close(lp[0], torch.log_softmax(logits[0] / 0.7, -1))
    for i, p in enumerate(params):
        alone = make_sampler([p], 20)
        torch.testing.assert_close(lp[i], alone.process(logits[i:i + 1], alone.start())[0])


def test_mirostat_through_the_pipeline():
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    sampler = make_sampler([SamplingParams(mirostat=2, mirostat_tau=1.25, mirostat_eta=0.1)], 4)
    state = sampler.start()  # mu = 2.5: keeps the tokens of surprise 1 and 2 bits
    lp = sampler.process(logits, state)
    torch.testing.assert_close(lp.exp(), torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    after = sampler.advance(state, torch.tensor([1]), lp)  # observed surprise log2(3) under the truncated p
    assert after.mu is not None
    assert after.mu.item() == pytest.approx(2.5 - 0.1 * (math.log2(3) - 1.25), abs=1e-6)
    assert state.mu is not None and state.mu.item() == 2.5


def test_xtc_coin_uses_the_row_generator():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]).log()
    always = make_sampler([SamplingParams(xtc_probability=1.0, xtc_threshold=0.15)], 5)
    assert torch.isfinite(always.process(logits, generators=[None])).tolist() == [[False, False, True, True, True]]
    half = make_sampler([SamplingParams(xtc_probability=0.5, xtc_threshold=0.15)], 5)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [bool(torch.isinf(half.process(logits, generators=[g])).any()) for _ in range(40)]

    assert run(3) == run(3) and 5 < sum(run(3)) < 35


def test_state_select_keeps_none_fields():
    assert SamplingState().select([0]) == SamplingState()


# ---- CLI flags

def test_cli_flags_build_every_sampler_parameter():
    from metaloom.cli import build_parser
    from metaloom.commands.common import sampling_params

    argv = ["generate", "hi", "--temperature", "0.9", "--dynatemp-range", "0.2", "--dynatemp-exponent", "2",
            "--top-n-sigma", "1.5", "--top-h", "0.4", "--top-k", "40", "--top-p", "0.9", "--min-p", "0.05",
            "--typical-p", "0.95", "--epsilon-cutoff", "0.001", "--eta-cutoff", "0.002", "--xtc-probability", "0.5",
            "--xtc-threshold", "0.2", "--mirostat", "2", "--mirostat-tau", "4", "--mirostat-eta", "0.2",
            "--repetition-penalty", "1.1", "--presence-penalty", "0.3", "--frequency-penalty", "0.4",
            "--dry-multiplier", "0.8", "--dry-base", "1.5", "--dry-allowed-length", "3", "--dry-penalty-last-n", "64",
            "--dry-sequence-breaker", ".", "--dry-sequence-breaker", "\n", "--no-repeat-ngram-size", "3",
            "--logit-bias", "5=-2.5", "--logit-bias", "7=1", "--max-tokens", "9", "--n", "2", "--seed", "3"]
    p = sampling_params(build_parser().parse_args(argv))
    assert p == SamplingParams(
        temperature=0.9, dynatemp_range=0.2, dynatemp_exponent=2.0, top_n_sigma=1.5, top_h=0.4, top_k=40, top_p=0.9,
        min_p=0.05, typical_p=0.95, epsilon_cutoff=0.001, eta_cutoff=0.002, xtc_probability=0.5, xtc_threshold=0.2,
        mirostat=2, mirostat_tau=4.0, mirostat_eta=0.2, repetition_penalty=1.1, presence_penalty=0.3,
        frequency_penalty=0.4, dry_multiplier=0.8, dry_base=1.5, dry_allowed_length=3, dry_penalty_last_n=64,
        dry_sequence_breakers=(".", "\n"), no_repeat_ngram_size=3, logit_bias={5: -2.5, 7: 1.0}, max_tokens=9, n=2,
        seed=3)
    defaults = sampling_params(build_parser().parse_args(["generate", "hi"]))
    assert defaults == SamplingParams()
    none = sampling_params(build_parser().parse_args(["generate", "hi", "--no-dry-sequence-breakers"]))
    assert none.dry_sequence_breakers == ()


@pytest.mark.parametrize(("flags", "needle"), [
    (["--mirostat", "1"], "mirostat"), (["--xtc-threshold", "0.7"], "xtc_threshold"),
    (["--logit-bias", "five=1"], "logit_bias"), (["--dry-base", "0.5"], "dry_base"),
    (["--no-dry-sequence-breakers", "--dry-sequence-breaker", "x"], "dry_sequence_breakers"),
])
def test_bad_sampler_flags_are_one_clear_line_before_loading_a_model(flags, needle, capsys):
    from metaloom.cli import main

    assert main(["generate", "hi", "--model", "/nonexistent/model.gguf", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]


# ---- the real model

def _repeats_an_ngram(prompt, output, n):
    """Whether some n-gram ending in the output already occurred earlier in prompt + output."""
    seq = list(prompt) + list(output)
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    first_new = len(prompt) - n + 1  # first n-gram whose last token is generated
    return any(g in grams[:i] for i, g in enumerate(grams) if i >= first_new)


def test_real_model_with_many_adapters(smollm_generator):
    from metaloom.generator import Request
    from metaloom.ledger import Ledger

    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, typical_p=0.98, epsilon_cutoff=1e-4,
                            top_n_sigma=2.5, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2,
                            dry_multiplier=0.8, no_repeat_ngram_size=3, xtc_probability=0.5, mirostat=2,
                            max_tokens=12, n=2, seed=0, ignore_eos=True)
    prompt = "List the days of the week: Monday, Tuesday, Wednesday,"
    out = smollm_generator.generate([Request(prompt, params)], ledger=Ledger())[0]
    ids = smollm_generator.tokenizer.encode(prompt)
    for c in out:
        assert len(c.token_ids) == 12 and c.finish_reason == "length" and c.text
        assert not _repeats_an_ngram(ids, c.token_ids, 3)
    greedy = SamplingParams(temperature=0, dry_multiplier=2.0, no_repeat_ngram_size=2, max_tokens=8)
    one = smollm_generator.generate([Request(prompt, greedy)], ledger=Ledger())[0][0]
    assert len(one.token_ids) >= 1 and not _repeats_an_ngram(ids, one.token_ids, 2)
