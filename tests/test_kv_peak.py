"""The ledger's ``kv_bytes_peak`` (issue 31): the most KV bytes a request's rows held at once,
measured exactly on the tiny native model, combined by max, unknown where it cannot be known.

The tiny model (`metaloom.testing.tiny`) keeps 2 layers x 2 kv heads x 8 dims of float32 keys
and values: 2 * 2 * 2 * 8 * 4 = 256 bytes a token slot. A token's KV is written when it is fed,
and the last token drawn is never fed: a P-token prompt that generates M tokens holds P + M - 1
slots at its peak.
"""

from __future__ import annotations

import json

import pytest
import torch

from metaloom.decode.contrastive import truncated_llama
from metaloom.decode.memory import BatchMemory, held_bytes
from metaloom.decode.specs import BeamParams, ContrastiveParams
from metaloom.errors import InvalidParameter
from metaloom.generator.local import LocalGenerator
from metaloom.generator.remote.wire import usage_charge
from metaloom.generator.types import Request, TokenIds
from metaloom.ledger import COUNTED, PEAKS, Budget, Ledger, Usage, parse_budget
from metaloom.models.load import LoadedModel
from metaloom.prefix.pool import PrefixCache
from metaloom.sampling.params import SamplingParams
from metaloom.speculative import Speculative
from metaloom.speculative.drafters.ngram import NgramDrafter
from metaloom.testing.tiny import tiny_llama
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

SLOT = 256  # bytes of one token's keys and values in the tiny model


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return tiny_llama()


def _greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0 if n == 1 else 1.0, max_tokens=max_tokens, ignore_eos=True, n=n, seed=3)


def _peak(gen: LocalGenerator, *requests: Request) -> int:
    ledger = Ledger()
    gen.generate(list(requests), ledger=ledger)
    assert "kv_bytes_peak" not in ledger.usage.unknown
    return ledger.usage.kv_bytes_peak


def test_the_tiny_models_slot_is_256_bytes(tiny):
    assert LocalGenerator(tiny).pool.bytes_per_slot == SLOT


def test_one_greedy_request_holds_its_prompt_and_every_fed_token(tiny):
    # P = 6, M = 5: the prompt's 6 slots, then tokens 1..4 fed (token 5 is drawn, never fed)
    assert _peak(LocalGenerator(tiny), Request("abcdef", _greedy(5))) == (6 + 5 - 1) * SLOT


def test_samples_forked_from_one_prompt_share_its_slots(tiny):
    # n = 4: the prompt once, then 4 rows of 4 fed tokens each: P + 4 (M - 1), not 4 (P + M - 1)
    assert _peak(LocalGenerator(tiny), Request("abcdef", _greedy(5, n=4))) == (6 + 4 * 4) * SLOT


def test_requests_on_one_ledger_in_one_batch_are_held_together(tiny):
    two = _peak(LocalGenerator(tiny), Request("abcdef", _greedy(5)), Request("fedcba", _greedy(3)))
    # after the second step both rows hold 6 + 2; then the 3-token row leaves (its third token
    # drawn, never fed) and the other peaks alone at 6 + 4: the most at once is 16, not 10 + 8
    assert two == ((6 + 2) + (6 + 2)) * SLOT


def test_prompt_slots_from_the_prefix_cache_count_once_per_ledger(tiny):
    gen = LocalGenerator(tiny, prefix_cache=PrefixCache(1 << 20))
    gen.generate([Request("abcdefgh", _greedy(1))], ledger=Ledger())  # stores "abcdefgh"
    ledger = Ledger()
    gen.generate([Request("abcdefghij", _greedy(3)), Request("abcdefghkl", _greedy(3))], ledger=ledger)
    assert ledger.usage.cached_tokens == 2 * 8
    # the 8 cached slots both rows were handed (once), each row's 2 computed prompt tokens,
    # then each row's 2 fed tokens: 8 + 2 * 2 + 2 * 2, where rows x length would say 2 * 12
    assert ledger.usage.kv_bytes_peak == (8 + 2 * 2 + 2 * 2) * SLOT


def test_a_continuation_from_the_prefix_cache_counts_the_slots_it_was_handed(tiny):
    gen = LocalGenerator(tiny, prefix_cache=PrefixCache(1 << 20))
    gen.generate([Request("abcdefgh", _greedy(1))], ledger=Ledger())
    ledger = Ledger()
    gen.generate([Request("abcdefghij", _greedy(4))], ledger=ledger)
    assert ledger.usage.cached_tokens == 8  # computed only 2 prompt tokens, but holds all 10
    assert ledger.usage.kv_bytes_peak == (10 + 4 - 1) * SLOT


def test_contrastive_decoding_counts_the_amateurs_cache_at_its_own_slot_size(tiny):
    amateur = truncated_llama(tiny.model, 1)  # one layer: 128 bytes a slot, in its own pool
    gen = LocalGenerator(tiny, amateur=amateur)
    assert gen.amateur_pool is not None and gen.amateur_pool.bytes_per_slot == SLOT // 2
    request = Request("abcdef", _greedy(5), decoder=ContrastiveParams(alpha=0.1))
    assert _peak(gen, request) == (6 + 5 - 1) * (SLOT + SLOT // 2)


def test_scoring_holds_the_prompt_once_and_every_continuation_token(tiny):
    ledger = Ledger()
    LocalGenerator(tiny).score(TokenIds((1, 2, 3, 4)), [TokenIds((5, 6, 7)), TokenIds((8, 9, 10, 11, 12))], ledger=ledger)
    assert ledger.usage.kv_bytes_peak == (4 + 3 + 5) * SLOT  # a scored token's KV is written (its logits are read)


def test_prompt_logprobs_hold_the_prompt_but_its_last_token(tiny):
    ledger = Ledger()
    LocalGenerator(tiny).prompt_logprobs(TokenIds(tuple(range(1, 11))), 2, ledger=ledger)
    assert ledger.usage.kv_bytes_peak == (10 - 1) * SLOT


def _brute_force(model, seen: list[int]):
    """``model.forward`` that records what every row of the cache holds after each forward,
    counted the slow, obvious way (every slot of every row, `np.unique`)."""
    inner = model.forward

    def forward(tokens, cache, **kw):
        out = inner(tokens, cache, **kw)
        seen.append(held_bytes(cache) or 0)
        return out
    return forward


def test_beam_search_counts_the_shared_past_of_its_beams_once(tiny, monkeypatch):
    seen: list[int] = []
    monkeypatch.setattr(tiny.model, "forward", _brute_force(tiny.model, seen))
    peak = _peak(LocalGenerator(tiny), Request("abcdef", _greedy(6), decoder=BeamParams(beams=3)))
    assert peak == max(seen)
    # beams fork each other's past: more than one row's worth, less than three rows of their own
    assert (6 + 6 - 1) * SLOT < peak < (6 + 3 * (6 - 1)) * SLOT


def test_speculative_decoding_counts_drafts_until_they_are_rolled_back(tiny, monkeypatch):
    seen: list[int] = []
    gen = LocalGenerator(tiny, speculative=Speculative(NgramDrafter(max_ngram=2), num_draft=4))
    monkeypatch.setattr(tiny.model, "forward", _brute_force(tiny.model, seen))
    ledger = Ledger()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["b"])
    out = gen.generate([Request("zyxzyxzyx", params)], ledger=ledger)[0][0]
    assert ledger.usage.rejected_tokens > 0 and out.finish_reason == "stop"
    assert ledger.usage.kv_bytes_peak == max(seen)
    # the stop string came inside a verified block: the drafts written past it were held, so
    # the peak is above what the kept tokens alone ever needed (9 + 11 - 1 slots)
    assert len(out.token_ids) == 11 and ledger.usage.kv_bytes_peak == (9 + 11 - 1 + 1) * SLOT


def test_usages_take_the_larger_peak_and_never_sum_it():
    assert PEAKS == ("kv_bytes_peak",) and set(PEAKS) <= set(COUNTED)
    total = Usage(output_tokens=2, kv_bytes_peak=5 * SLOT) + Usage(output_tokens=3, kv_bytes_peak=3 * SLOT)
    assert (total.output_tokens, total.kv_bytes_peak) == (5, 5 * SLOT)
    parent = Ledger()
    child = parent.child()
    child.charge(kv_bytes_peak=3 * SLOT)
    parent.charge(kv_bytes_peak=2 * SLOT)  # a later, smaller call: the peak stays
    child.charge(kv_bytes_peak=4 * SLOT)
    assert (parent.usage.kv_bytes_peak, child.usage.kv_bytes_peak) == (4 * SLOT, 4 * SLOT)
    assert sum([Usage(kv_bytes_peak=1), Usage(kv_bytes_peak=7), Usage(kv_bytes_peak=2)], Usage()).kv_bytes_peak == 7


def test_the_usage_since_a_snapshot_knows_a_peak_only_where_it_rose():
    before = Usage(output_tokens=2, kv_bytes_peak=10)
    rose = Usage(output_tokens=5, kv_bytes_peak=12).since(before)
    assert (rose.output_tokens, rose.kv_bytes_peak, rose.unknown) == (3, 12, frozenset())
    stayed = Usage(output_tokens=5, kv_bytes_peak=10).since(before)
    assert stayed.to_dict()["kv_bytes_peak"] is None and stayed.output_tokens == 3  # at most 10: not known
    first = Usage(kv_bytes_peak=8).since(Usage())
    assert first.kv_bytes_peak == 8 and not first.unknown


def test_a_budget_on_kv_memory_ends_the_rows_past_it(tiny):
    assert parse_budget(["kv_bytes_peak=4096"]) == Budget(kv_bytes_peak=4096)
    with pytest.raises(InvalidParameter):
        parse_budget(["kv_bytes_peak=1.5"])
    ledger = Ledger(budget=Budget(kv_bytes_peak=(6 + 3) * SLOT))
    out = LocalGenerator(tiny).generate([Request("abcdef", _greedy(10))], ledger=ledger)[0][0]
    assert out.finish_reason == "budget" and len(out.token_ids) == 5  # stopped the step it passed 9 slots


def test_a_remote_server_that_reports_no_memory_leaves_it_unknown():
    plain = Usage(**usage_charge({"prompt_tokens": 3, "completion_tokens": 2}, None))
    assert plain.to_dict()["kv_bytes_peak"] is None  # unknown: None, never a misleading 0
    with pytest.raises(InvalidParameter):
        Budget(kv_bytes_peak=100).check(plain)
    metaloom = {"prompt_tokens": 3, "completion_tokens": 2,
                "metaloom": {"forward_passes": 2, "flops": 10.0, "kv_bytes_peak": 4 * SLOT}}
    served = Usage(**usage_charge(metaloom, None))
    assert served.kv_bytes_peak == 4 * SLOT and not served.unknown


def test_a_cache_without_slots_reports_the_figure_unknown():
    table = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))
    loaded = LoadedModel(model=MarkovModel(table), tokenizer=CharTokenizer(6, eos=5), name="toy", folder="",
                         dtype=torch.float32)
    ledger = Ledger()
    LocalGenerator(loaded).generate([Request("ab", _greedy(3))], ledger=ledger)
    assert ledger.usage.to_dict()["kv_bytes_peak"] is None and ledger.usage.output_tokens == 3


def test_the_measure_needs_no_pass_over_every_slot_per_step(tiny, monkeypatch):
    """After the prompt's rows joined, steps only sum lengths: `np.unique` runs when rows join
    or leave, not once per step."""
    calls = []
    real = BatchMemory._count_shared
    monkeypatch.setattr(BatchMemory, "_count_shared", lambda self, parts: calls.append(len(self.dirty)) or real(self, parts))
    assert _peak(LocalGenerator(tiny), Request("abcdef", _greedy(20, n=2))) == (6 + 2 * 19) * SLOT
    assert calls == [1]  # when the rows joined; 19 steps later they leave together, uncounted


def test_rows_that_leave_free_their_slots_and_only_their_ledger_is_counted_again(tiny, monkeypatch):
    calls = []
    real = BatchMemory._count_shared
    monkeypatch.setattr(BatchMemory, "_count_shared", lambda self, parts: calls.append(len(self.dirty)) or real(self, parts))
    gen = LocalGenerator(tiny, prefill_overhead_tokens=0)  # each prompt length prefills (and joins) apart
    batch = gen.new_batch()
    mine, other = Ledger(), Ledger()
    rows = [*gen.rows_for(Request("abcdefghijklmnopqrst", _greedy(2)), mine),
            *gen.rows_for(Request("ab", _greedy(30)), mine), *gen.rows_for(Request("cd", _greedy(30)), other)]
    batch.admit(rows)
    while batch.rows:
        batch.step()
    # after step 1 the 20-token prompt's row (21 slots) leaves beside the other's 3; alone, that
    # row then reaches 2 + 29: 31 slots, where keeping the gone prompt would say 22 + 29
    assert mine.usage.kv_bytes_peak == 31 * SLOT and other.usage.kv_bytes_peak == 31 * SLOT
    # the two 2-token prompts join (both ledgers), then the 20-token one (mine); when its row
    # leaves, only mine is counted again
    assert calls == [2, 1, 1]


# --- metaloom eval: accuracy against memory ------------------------------------------------------


def tiny_engine() -> LocalGenerator:
    """The factory the sweep below names (``Setup.factory``)."""
    return LocalGenerator(tiny_llama())


def test_eval_draws_accuracy_against_peak_kv_memory(tmp_path):
    from metaloom.eval.analysis import analyze
    from metaloom.eval.report.figure_layout import family_styles
    from metaloom.eval.report.figures import draw_accuracy
    from metaloom.eval.runner import plan_sweep, run_sweep
    from metaloom.eval.worker import Setup

    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in ("abcdef", "ghij")))
    setup = Setup(task=f"jsonl:{path}", factory=f"{__name__}:tiny_engine", max_tokens=6, temperature=1.0)
    records = run_sweep(plan_sweep(setup, ["greedy", "majority_vote@n=4"], str(tmp_path / "out")))
    by = {(r.problem, r.strategy): r for r in records}
    first = sorted({r.problem for r in records})[0]
    greedy, pooled = by[(first, "greedy")], by[(first, "majority_vote@n=4")]
    prompt = greedy.usage["input_tokens"]
    assert greedy.usage["kv_bytes_peak"] == (prompt + greedy.usage["output_tokens"] - 1) * SLOT
    # a pooled run's peak is split into the prompt's share and each sample's own; they add up
    assert pooled.shared["kv_bytes_peak"] + sum(c.kv_bytes for c in pooled.candidates) == pytest.approx(
        pooled.usage["kv_bytes_peak"])
    assert pooled.shared["kv_bytes_peak"] == pytest.approx(
        pooled.usage["kv_bytes_peak"] * prompt / (prompt + sum(c.tokens - 1 for c in pooled.candidates)))

    analysis = analyze(records, seed=0, draws=20, bootstrap=50)
    assert "kv_bytes_peak" in analysis["frontier"]
    mv = next(c for c in analysis["curves"] if c["family"] == "majority_vote")
    memory = [p["kv_bytes_peak"] for p in mv["points"]]  # n = 1, 2, 4 read off the one pool of 4
    assert len(memory) == 3 and memory == sorted(memory) and memory[0] > 0
    fig, _ = draw_accuracy(analysis["curves"], analysis["frontier"], family_styles([c["family"] for c in analysis["curves"]]))
    assert [ax.get_xlabel() for ax in fig.axes][-1] == "mean peak KV memory per problem (bytes)"
    # without a measured peak (a server that reports none, an older sweep) the panel is left out
    for curve in analysis["curves"]:
        for p in curve["points"]:
            p["kv_bytes_peak"] = None
    fig, _ = draw_accuracy(analysis["curves"], analysis["frontier"], family_styles([c["family"] for c in analysis["curves"]]))
    assert len(fig.axes) == 3


def test_the_rounds_table_totals_a_peak_by_its_highest_round():
    from rich.console import Console

    from metaloom.present.tree import rounds_table

    # round 2 stayed under round 1's peak, so its own is unknown (`Usage.since`); the run's is 3 KiB
    rounds = [{"round": r, "usage": {"output_tokens": 4, "kv_bytes_peak": kv}} for r, kv in ((1, 2048), (2, None), (3, 3072))]
    table = rounds_table({"rounds": rounds})
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    total = next(line for line in text.splitlines() if line.strip().startswith("total"))
    assert "3 KiB" in total and "12" in total and "7 KiB" not in total  # max, not a sum; counts still add
    assert "2 KiB" in text and "?" in text


def test_a_draft_models_own_cache_counts_too(tiny, monkeypatch):
    from metaloom.speculative.drafters.draft_model import DraftModelDrafter

    draft = tiny_llama(seed=1).model  # the tiny shape: its own pool, 256 bytes a slot too
    seen: list[int] = []
    drafted: list[object] = []
    inner_draft = draft.forward

    def draft_forward(tokens, cache, **kw):
        drafted[:] = [cache]  # the draft cache of the step being verified next
        return inner_draft(tokens, cache, **kw)

    inner = tiny.model.forward

    def target_forward(tokens, cache, **kw):
        out = inner(tokens, cache, **kw)
        seen.append((held_bytes(cache) or 0) + (held_bytes(drafted[0]) or 0 if drafted else 0))
        return out

    gen = LocalGenerator(tiny, speculative=Speculative(DraftModelDrafter(draft), num_draft=3))
    monkeypatch.setattr(draft, "forward", draft_forward)
    monkeypatch.setattr(tiny.model, "forward", target_forward)
    ledger = Ledger()
    out = gen.generate([Request("abcdef", _greedy(10, n=2))], ledger=ledger)[0]
    assert ledger.usage.verify_steps > 0
    assert ledger.usage.kv_bytes_peak == max(seen)
    # more than the target's rows alone ever need: the draft model holds each row's context too
    assert ledger.usage.kv_bytes_peak > (6 + sum(len(c.token_ids) - 1 for c in out)) * SLOT


def test_the_servers_usage_reports_each_requests_peak_and_a_remote_generator_takes_it():
    import httpx2 as httpx

    from metaloom.generator.remote import RemoteGenerator
    from metaloom.server.app import create_app
    from metaloom.testing.served import serve_app

    app = create_app(LocalGenerator(tiny_llama()), model_ids=["default"], max_rows=8)
    with serve_app(app) as url:
        body = {"model": "default", "prompt": "abcdef", "n": 4, "max_tokens": 5, "temperature": 1, "ignore_eos": True}
        usage = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
        assert usage["prompt_tokens"] == 6 and usage["metaloom"]["kv_bytes_peak"] == (6 + 4 * 4) * SLOT
        remote = RemoteGenerator(url, model="default")
        try:
            ledger = Ledger()
            remote.generate([Request(TokenIds((0, 1, 2, 3, 4, 5)), _greedy(5, n=4))], ledger=ledger)
        finally:
            remote.close()
    assert ledger.usage.kv_bytes_peak == (6 + 4 * 4) * SLOT and "kv_bytes_peak" not in ledger.usage.unknown
