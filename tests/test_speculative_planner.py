"""The speculation cost model (`metaloom.speculative.planner`, `cost`, `planned`): its arithmetic
on hand-made numbers, the verify cost it measures, and in the decode loop that it drafts what
pays, drafts nothing when nothing pays, picks the drafter that pays (auto), keeps greedy exact,
and reports what it chose."""

import numpy as np
import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.speculative import Draft, Speculative, with_cost_model
from metaloom.speculative.acceptance import COLD, HOT, Acceptance, rates
from metaloom.speculative.cost import VerifyCost, measure_verify_cost, monotone
from metaloom.speculative.drafter import Verified
from metaloom.speculative.drafters.ngram import NgramDrafter
from metaloom.speculative.planned import Outcome, PlannedDrafter, as_chain, kept_paths
from metaloom.speculative.planned_state import Choice
from metaloom.speculative.planner import (
    PROBE_EVERY,
    WIDE_POINTS,
    DraftCost,
    Probe,
    Timing,
    fit_overhead,
    plan_length,
    prune,
)
from metaloom.speculative.tree import DraftTree
from metaloom.testing.tiny import tiny_llama
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

FLAT = VerifyCost((1, 65), (1.0, 1.0))  # an accelerator far from saturation: any width costs a step
STEEP = VerifyCost((1, 2, 65), (1.0, 2.0, 65.0))  # every verified token costs a whole step
NODE_04 = VerifyCost((1, 65), (1.0, 1.0 + 64 * 0.4))  # a verified node costs 0.4 of a step: one fits a fresh budget


def _timing(cost, fixed=0.0):
    return Timing(cost, 1.0, fixed)


# --- arithmetic ------------------------------------------------------------------------------


def test_rates_shrink_towards_a_geometric_continuation_and_never_rise():
    tried, kept = np.array([10.0, 10.0, 0.0]), np.array([9.0, 5.0, 0.0])
    a1 = (9 + 2 * 0.5) / 12
    a2 = (5 + 2 * a1 * a1) / 12
    a3 = a2 * (a2 / a1)  # never verified: priced from the two before it
    assert rates(tried, kept) == pytest.approx([a1, a2, a3])
    # a later node observed more often accepted than an earlier one is priced no higher
    assert rates(np.array([10.0, 10.0]), np.array([2.0, 9.0]))[1] == pytest.approx(rates(np.array([10.0]),
                                                                                         np.array([2.0]))[0])


def test_prune_keeps_the_length_with_the_best_rate():
    cost = VerifyCost((1, 2, 3, 4, 5), (1.0, 1.1, 1.2, 2.0, 2.2))
    a = np.array([0.9, 0.8, 0.7, 0.6])
    # rates: 1/1, 1.9/1.1, 2.7/1.2 (best), 3.4/2.0, 4.0/2.2
    assert prune([a], [4], 1, _timing(cost)) == [2]
    assert prune([a], [1], 1, _timing(cost)) == [1]  # cut by what was proposed
    assert prune([a], [4], 1, _timing(FLAT)) == [4]  # free verification keeps everything
    assert prune([a], [4], 1, _timing(STEEP)) == [0]  # 1.9 tokens for 2 steps: nothing pays
    assert prune([a], [4], 1, _timing(STEEP), extra=1) == [1]  # a probe verifies one more
    assert prune([a], [0], 1, _timing(STEEP), extra=1) == [0]


def test_prune_takes_the_best_nodes_across_rows():
    cost = VerifyCost((1, 2, 3, 4, 5), (1.0, 1.0, 1.0, 1.05, 3.0))  # 2 live rows: width 2 + m
    hot, cold = np.array([0.9, 0.9, 0.9]), np.array([0.1, 0.05, 0.01])
    # m=0: 2/1.0; m=1: (2 + .9)/1.0; m=2: (2 + 1.8)/1.05 best; m=3: (2 + 2.7)/3.0
    assert prune([cold, hot], [3, 3], 2, _timing(cost)) == [0, 2]


def test_plan_length_weighs_the_drafters_own_time():
    a = [np.array([0.8, 0.64, 0.5])]
    sure = [np.ones(3)]
    costly = DraftCost(fixed=0.0, per_token=0.6, fixed_samples=1, token_samples=1)
    free = DraftCost(fixed=0.0, per_token=0.0)
    # drafting costs 0.6 of a step a token: 1.8 tokens for 1.6 steps at best -> 1 token pays (1.8/1.6 > 1)
    assert plan_length(a, sure, [3], 1, _timing(FLAT), costly, 3) == (1, pytest.approx(1.8 / 1.6))
    slow = DraftCost(fixed=0.0, per_token=1.0, fixed_samples=1, token_samples=1)
    assert plan_length(a, sure, [3], 1, _timing(FLAT), slow, 3)[0] == 0
    # a drafter that costs nothing drafts all it may and lets prune choose
    assert plan_length(a, sure, [3], 1, _timing(STEEP), free, 3)[0] == 3
    assert plan_length(a, sure, [2], 1, _timing(FLAT), costly, 3)[0] == 1


def test_acceptance_counts_decay_and_are_kept_per_state():
    acc = Acceptance(4)
    for _ in range(50):
        acc.record(1, 4, [0, 1, 2, 3])
        acc.record(0, 2, [])
    assert acc.kept_rates(1)[3] > 0.9 and acc.kept_rates(0)[0] < 0.1
    acc.record_proposal(0, 4, 1)
    assert acc.proposal_rates(0)[0] == pytest.approx(1.0) and acc.proposal_rates(0)[1] < 1.0


def test_acceptance_is_also_learned_per_confidence_class():
    acc = Acceptance(3)
    for _ in range(40):
        acc.record(0, 3, [0, 1, 2], level=2)  # long matches: kept
        acc.record(0, 3, [], level=0)  # one-token matches: rejected
    assert acc.kept_rates(0, 2)[0] > 0.9 and acc.kept_rates(0, 0)[0] < 0.1
    assert 0.4 < acc.kept_rates(0)[0] < 0.6  # the state over every class
    # a class never seen: priced from the less sure class 0 (rejected), not the surer class 2
    assert acc.kept_rates(0, 1)[0] < 0.1
    assert acc.kept_rates(0, 3)[0] == pytest.approx(acc.kept_rates(0)[0])  # none surer drafted: the state's
    fifth = VerifyCost((1, 65), (1.0, 1.0 + 0.2 * 64))  # each verified token costs a fifth of a step
    assert prune([acc.kept_rates(0, 2), acc.kept_rates(0, 0)], [3, 3], 2, _timing(fifth)) == [3, 0]


def test_a_class_not_yet_verified_is_not_priced_from_surer_ones():
    """Prompt lookup on SmolLM2's grounded prompts: 3-token matches kept, then a first 1-token
    match priced at the state's 0.75 a node verified 7-10 nodes and kept none (issue 47)."""
    acc = Acceptance(8)
    for _ in range(10):
        acc.record(HOT, 8, list(range(8)), level=2)
    assert acc.kept_rates(HOT)[0] > 0.8
    fresh = Acceptance(8).kept_rates(HOT)  # the prior: what a class with no evidence at or below it gets
    assert acc.kept_rates(HOT, 0) == pytest.approx(fresh)
    assert acc.kept_rates(HOT, 2)[0] > 0.9  # the surest class drafted: its own counts, shrunk towards the state's
    seconds = VerifyCost((1, 2, 9), (1.0, 1.3, 2.7))  # the first node costs 0.3 of a step, each further one 0.2
    assert prune([acc.kept_rates(HOT, 0)], [8], 1, _timing(seconds)) == [2]  # the prior's 0.5, 0.25: two
    assert prune([acc.kept_rates(HOT, 2)], [8], 1, _timing(seconds)) == [8]
    for _ in range(10):  # once its own drafts are kept, the class earns its own price
        acc.record(HOT, 8, list(range(8)), level=0)
    assert acc.kept_rates(HOT, 0)[0] > 0.8


def test_a_fresh_planner_prices_prompt_lookup_s_matches_by_their_length():
    """Before a request has shown anything, a copy after a 3-token match is worth more than one
    after a single token (`NgramDrafter.class_priors`): 5 nodes against none, where without the
    priors every class verified 2."""
    seconds = VerifyCost((1, 2, 9), (1.0, 1.3, 2.7))  # the first node costs 0.3 of a step, each further one 0.2
    acc = PlannedDrafter([(NgramDrafter(), 8)], cost=seconds).acceptance[0]
    assert [prune([acc.kept_rates(COLD, level)], [8], 1, _timing(seconds)) for level in range(3)] == [[0], [2], [5]]
    assert acc.kept_rates(HOT, 2)[0] > 0.6 > 0.3 > acc.kept_rates(HOT, 0)[0]
    for _ in range(40):  # the priors weigh two observations each: a request's own record soon decides
        acc.record(COLD, 8, [], level=2)
    assert acc.kept_rates(COLD, 2)[0] < 0.1
    plain = PlannedDrafter([(Oracle(True, "x"), 8)], cost=seconds).acceptance[0]  # no classes: the prior alone
    assert plain.kept_rates(COLD) == Acceptance(8).kept_rates(COLD)


def test_prompt_lookup_gives_the_matched_length_as_its_class():
    state = NgramDrafter(max_ngram=3).start(None, None, [[1, 2, 3, 4, 1, 2, 3]] * 2, [0, 0])
    draft = state.propose([[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 9, 8, 7]], [2, 2], None)
    assert draft.tokens.tolist() == [[4, 1], [9, 8]] and draft.levels == (2, 0)


def test_draft_cost_learns_fixed_and_per_token_parts():
    d = DraftCost()
    d.record(0, 0.001)
    d.record(4, 0.009)
    assert d.seconds(0) == pytest.approx(0.001) and d.per_token == pytest.approx(0.002)


def test_draft_cost_tells_a_call_from_its_tokens_once_the_limits_differ():
    flat, model = DraftCost(), DraftCost()  # prompt lookup's index update; a draft model's forwards
    flat.record(0, 0.001)
    model.record(0, 0.001)
    for k in (3, 10, 6, 3, 10, 8, 4):
        flat.record(k, 0.001 + 0.05)
        model.record(k, 0.001 + 0.002 + 1.0 * k)
    assert flat.per_token == pytest.approx(0.0, abs=1e-9) and flat.seconds(10) == pytest.approx(0.051)
    assert flat.seconds(0) == pytest.approx(0.001)  # a step it is not asked in pays the planning alone
    assert model.per_token == pytest.approx(1.0) and model.call == pytest.approx(0.002, abs=1e-9)
    same = DraftCost()
    for _ in range(3):  # one limit: no slope to tell, the whole time per token
        same.record(5, 0.5)
    assert same.per_token == pytest.approx(0.1) and same.call == 0.0


def test_probe_interval_doubles_until_a_trial_wins():
    p = Probe()
    assert not p.due(PROBE_EVERY - 1) and p.due(PROBE_EVERY)
    p.tried(PROBE_EVERY, won=False)
    assert p.interval == 2 * PROBE_EVERY and not p.due(2 * PROBE_EVERY)
    p.tried(100, won=True)
    assert p.interval == PROBE_EVERY


def test_verify_cost_interpolates_and_refuses_bad_curves():
    c = VerifyCost((1, 2, 4), (1.0, 1.5, 3.5))
    assert c.seconds_for(3) == pytest.approx(2.5) and c.seconds_for(6) == pytest.approx(5.5)
    assert c.relative(1.5) == pytest.approx(1.25)
    assert monotone([1.0, 0.9, 2.0]) == [1.0, 1.0, 2.0]
    with pytest.raises(InvalidParameter, match="widths"):
        VerifyCost((2, 4), (1.0, 2.0))
    with pytest.raises(InvalidParameter, match="seconds"):
        VerifyCost((1, 2), (1.0,))


def test_measure_verify_cost_times_every_width_up_to_the_most():
    model = tiny_llama().model
    cost = measure_verify_cost(model, most=7, repeats=1)
    assert cost.widths == (1, 2, 3, 4, 5, 6, 7)
    assert all(b >= a > 0 for a, b in zip(cost.seconds, cost.seconds[1:], strict=False))
    with pytest.raises(InvalidParameter, match="most"):
        measure_verify_cost(model, most=0)


class _Timed:
    """A model whose forward of w tokens takes w ms on a fake clock, except the forwards
    ``spikes`` picks (by call number), which take 50 ms more: other work on a shared machine."""

    def __init__(self, model, spikes):
        self.model, self.spikes, self.now, self.calls = model, spikes, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, cache, **kw):
        self.calls += 1
        self.now += 1e-3 * tokens.shape[1] + (0.05 if self.calls in self.spikes else 0.0)
        return self.model.forward(tokens, cache, **kw)


def test_measure_verify_cost_keeps_each_widths_least_time():
    """Noise only adds time: a width two of whose three timed forwards were slowed (call 1 is
    the prefill, 2-15 the warm-up round; each timed forward follows an untimed one-token one, so
    width 1 is timed at calls 17, 31, 45 and width 3 at 21, 35, 49) is read at its clean time,
    and the spikes do not reach the wider widths through `monotone`."""
    timed = _Timed(tiny_llama().model, spikes={17, 31, 21})  # width 1 twice, width 3 once
    cost = measure_verify_cost(timed, most=7, repeats=3, clock=lambda: timed.now)
    assert cost.seconds == pytest.approx(tuple(1e-3 * w for w in cost.widths))
    # the one-token step's median (51 ms: two of three spiked) over its least (1 ms)
    assert cost.typical == pytest.approx(51.0)


class _Cold(_Timed):
    """Each forward after one of 5 tokens or more takes 0.3 ms more (its caches refilled)."""

    def forward(self, tokens, cache, **kw):
        self.now += 3e-4 if getattr(self, "last", 1) >= 5 else 0.0
        self.last = tokens.shape[1]
        return super().forward(tokens, cache, **kw)


def test_measure_verify_cost_times_no_width_right_after_a_wide_one():
    """Timed in rounds of widths 1, 2, ..., 7, width 1 followed the round before's width 7 and
    paid its cold caches every time: read at 1.3 ms against width 2's 2 ms, a node looked to cost
    0.54 of a step where it costs 1 (SmolLM2 on a Zen 5 read 2 tokens at 1.00x one)."""
    timed = _Cold(tiny_llama().model, spikes=set())
    cost = measure_verify_cost(timed, most=7, repeats=3, clock=lambda: timed.now)
    assert cost.seconds == pytest.approx(tuple(1e-3 * w for w in cost.widths))


def test_a_fresh_planner_starts_at_the_typical_level():
    """A plain step's usual time, not its best, until steps are observed: the one-token median
    over the least time scales the curve from the first plan."""
    from metaloom.sampling.pipeline import make_sampler

    target = tiny_llama().model
    planned = PlannedDrafter([(Oracle(True, "right"), 4)], cost=VerifyCost((1, 65), (1.0, 1.0), typical=1.25))
    sampler = make_sampler([SamplingParams(temperature=0, max_tokens=8)], target.vocab_size, target.device)
    planned.start(target, sampler, [[1, 2, 3]], [0])
    assert planned.scale == 1.25 and planned.timing().seconds(1) == pytest.approx(1.25)
    with pytest.raises(InvalidParameter, match="typical"):
        VerifyCost((1, 2), (1.0, 2.0), typical=0.5)


# --- in the decode loop ----------------------------------------------------------------------

V = 5
TABLE = torch.log(torch.tensor([[0.05, 0.8, 0.05, 0.05, 0.05], [0.05, 0.05, 0.8, 0.05, 0.05],
                                [0.05, 0.05, 0.05, 0.8, 0.05], [0.8, 0.05, 0.05, 0.05, 0.05],
                                [0.2, 0.2, 0.2, 0.2, 0.2]]))  # greedy: 0 -> 1 -> 2 -> 3 -> 0 ...


class Oracle:
    """Proposes the greedy continuation (right) or an impossible-to-accept token (wrong)."""

    def __init__(self, right: bool, name: str):
        self.right, self.name = right, name

    def start(self, target, sampler, contexts, keys):
        return self

    def propose(self, contexts, limits, ledger):
        drafts = []
        for ctx, limit in zip(contexts, limits, strict=True):
            t, out = ctx[-1], []
            for _ in range(limit):
                t = (t + 1) % 4 if self.right else 4
                out.append(t)
            drafts.append(out)
        return Draft.from_lists(drafts)

    def observe(self, verified):
        pass

    def select(self, rows):
        return self

    def join(self, other):
        return self


def _run(speculative, max_tokens=200):
    loaded = LoadedModel(model=MarkovModel(TABLE), tokenizer=CharTokenizer(V, None), name="toy", folder="",
                         dtype=torch.float32)
    ledger = Ledger()
    out = LocalGenerator(loaded, speculative=speculative).generate(
        [Request("a", SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))], ledger=ledger)
    return out[0][0].token_ids, ledger.usage


def test_free_verification_and_right_drafts_draft_long():
    planned = PlannedDrafter([(Oracle(True, "right"), 8)], cost=FLAT)
    tokens, usage = _run(Speculative(planned, 8))
    plain, _ = _run(None)
    assert tokens == plain
    assert usage.verify_steps < 40 and usage.accepted_tokens > 150  # ~9 tokens a step once learned
    report = planned.report()
    assert report["drafters"]["right"]["steps"] == usage.verify_steps - report["nodes_verified"].get("0", 0)
    assert max(int(k) for k in report["nodes_verified"]) == 8


def test_nothing_pays_drafts_only_probes():
    """Every verified token costs a step and the drafts are always wrong: after the first trial
    the planner verifies nothing but its backed-off trials."""
    planned = PlannedDrafter([(Oracle(False, "wrong"), 8)], cost=STEEP)
    tokens, usage = _run(Speculative(planned, 8))
    plain, _ = _run(None)
    assert tokens == plain
    assert usage.accepted_tokens == 0
    # the one-node-longer probes back off too: at steps 16, 48, 112 (not every 16th), a node each
    assert usage.drafted_tokens <= 8, usage.drafted_tokens
    off, usage_off = _run(Speculative(Oracle(False, "wrong"), 8))  # without the cost model: 8 a step
    assert off == plain and usage_off.drafted_tokens > 1000


def test_auto_picks_the_drafter_that_pays():
    planned = PlannedDrafter([(Oracle(False, "wrong"), 4), (Oracle(True, "right"), 4)], cost=FLAT)
    tokens, _ = _run(Speculative(planned, 4))
    assert tokens == _run(None)[0]
    report = planned.report()["drafters"]
    assert report["right"]["steps"] > 5 * max(report["wrong"]["steps"], 1)
    assert report["right"]["kept"] == report["right"]["verified"]
    assert planned.name == "auto"


def test_kept_nodes_and_as_chain_follow_the_accepted_path_of_a_tree():
    #   root -> 0 (7) -> 2 (9)
    #        -> 1 (8) -> 3 (6)
    draft = Draft.from_trees([DraftTree((7, 8, 9, 6), (-1, -1, 0, 1))])
    tokens = torch.tensor([[8, 6, 5, 0, 0]])
    logits = torch.arange(5.0)[None, :, None].expand(1, 5, 3)  # block position i holds i
    hidden = torch.arange(5.0)[None, :, None].expand(1, 5, 2)
    verified = Verified(draft=draft, logits=logits, accepted=torch.tensor([2]), tokens=tokens, hidden=hidden)
    assert kept_paths(verified) == [[1, 3]]
    chain = as_chain(verified)
    assert chain.draft.parents is None and chain.draft.tokens.tolist() == [[8, 6]]
    assert chain.logits[0, :, 0].tolist() == [0.0, 2.0, 4.0]  # pending, node 1, node 3
    assert chain.hidden[0, 2, 0] == 4.0


def test_with_cost_model_measures_the_verify_cost_on_first_use():
    spec = with_cost_model(Oracle(True, "right"), 4)
    assert isinstance(spec.drafter, PlannedDrafter) and spec.drafter.cost is None
    tokens, usage = _run(spec, max_tokens=40)
    assert tokens == _run(None, max_tokens=40)[0]
    assert spec.drafter.cost is not None and spec.drafter.cost.widths == (1, 2, 3, 4, 5)
    assert usage.accepted_tokens > 0


def test_one_node_longer_probes_back_off_while_they_keep_nothing():
    """A drafter cheap enough to draft all it may and prune after (its own time counts 0), on a
    cost curve where no node pays at these estimates (it is not even asked to propose but for the
    probes), and every probe's extra node is rejected: so the probes come at
    steps 16, 48, 112, 240 (the interval doubling), not every 16th; one that keeps a node brings
    the interval back to `PROBE_EVERY`."""
    planned = PlannedDrafter([(Oracle(False, "wrong"), 8)], cost=STEEP)
    planned.budget.lost = -100.0  # earned by earlier drafts: room for the probes' nodes (a step each here)

    def steps(n: int, keep_at: int = -1) -> list[int]:
        probed = []
        for _ in range(n):
            choice = planned.plan([COLD], [8])
            assert choice.k == (8 if choice.extra else 0)  # cheap, but only a probe could be kept
            verified = int(choice.extra)
            kept = [[0]] if choice.extra and planned.step == keep_at else [[]]
            planned.learn(choice, Outcome([COLD], [8], [8], [verified], kept, 0.0, 1.0, 1 + verified))
            if choice.extra:
                probed.append(planned.step)
        return probed

    assert steps(300) == [16, 48, 112, 240]
    assert steps(300, keep_at=496) == [496, 512, 544]  # 240 + 256; it kept a node: 16 again, then doubling


def test_may_pay_false_means_prune_keeps_nothing_whatever_is_proposed():
    """Skipping the proposal is exact: whenever `may_pay` says no, `prune` verifies no node of
    any draft the drafter could have proposed (any lengths, any confidence classes), and with
    a flat cost curve a drafter with any chance of acceptance is asked."""
    from metaloom.speculative.drafter import LEVELS
    from metaloom.speculative.planner import Timing, prune

    rng = np.random.default_rng(0)
    refused = 0
    for trial in range(300):
        widths = np.array([1, 2, 4, 8, 65])  # a one-token step, then each token about `slope` steps more
        steps = 1.0 + rng.uniform(0.1, 1.0) * (widths - 1) * rng.uniform(0.9, 1.1, 5)
        steps[0] = 1.0
        planned = PlannedDrafter([(Oracle(False, "x"), 6)], cost=VerifyCost((1, 2, 4, 8, 65), tuple(monotone(steps.tolist()))))
        acc = planned.acceptance[0]
        for _ in range(int(rng.integers(0, 40))):  # a random history of kept nodes per state and class
            verified = int(rng.integers(1, 7))
            acc.record(int(rng.integers(0, 2)), verified, list(range(int(rng.integers(0, verified + 1)) // 2)),
                       int(rng.integers(0, LEVELS)))
        rows = int(rng.integers(1, 4))
        hot = [int(rng.integers(0, 2)) for _ in range(rows)]
        timing = Timing(planned.cost, 1.0, float(rng.uniform(0, 0.5)))
        if planned.may_pay(0, hot, [6] * rows, timing, rows):
            continue
        refused += 1
        for _ in range(10):
            levels = [int(rng.integers(0, LEVELS)) for _ in range(rows)]
            lengths = [int(rng.integers(0, 7)) for _ in range(rows)]
            kept = [acc.kept_rates(h, lv) for h, lv in zip(hot, levels, strict=True)]
            assert prune(kept, lengths, rows, timing) == [0] * rows, trial
    assert 30 < refused < 270  # both cases were exercised
    flat = PlannedDrafter([(Oracle(False, "x"), 6)], cost=FLAT)
    assert flat.may_pay(0, [HOT], [6], Timing(FLAT, 1.0, 0.0), 1)


# --- the exploration budget (conservative bandits) -------------------------------------------

def _simulate(planned, steps, accept):
    """Drive plan / keep / afford / learn on one row without a model: a step of width w takes
    exactly the curve's ``seconds_for(w)`` (no drafting time, no gap), and ``accept(m)`` says
    which of the m verified nodes are kept. Returns, after every step, the time lost against plain
    steps so far and the time elapsed, undecayed and as the budget holds them (decayed over
    `WINDOW` steps); and the nodes verified."""
    lost, elapsed, trace, verified = 0.0, 0.0, [], 0
    for _ in range(steps):
        choice = planned.plan([COLD], [8])
        proposed = [choice.k]
        keep = planned.keep(choice, [COLD], proposed, 1, 0.0) if choice.k else [0]
        if any(keep):
            keep = planned.afford(keep, 1)
        kept = accept(keep[0])
        t = planned.cost.seconds_for(1 + keep[0])
        planned.learn(choice, Outcome([COLD], [choice.k], proposed, keep, [kept], 0.0, t, 1 + keep[0]))
        lost += t - (1 + len(kept)) * planned.cost.seconds_for(1)
        elapsed += t
        verified += keep[0]
        trace.append((lost, elapsed, planned.budget.lost, planned.budget.elapsed))
    return trace, verified


def test_the_budget_bounds_what_wrong_drafters_lose_and_they_are_still_tried():
    """Two drafters nothing of which is ever accepted, on a curve where a verified node costs a
    third of a step, so that the optimistic prior (half of first nodes accepted) makes drafting
    look worth it at first: the time lost against plain decoding stays within `SAFETY` of the time
    spent plus the allowance at every step, while the drafters are still tried now and then."""
    from metaloom.speculative.planner import ALLOWANCE, SAFETY

    cost = VerifyCost((1, 65), (1.0, 1.0 + 64 / 3))
    planned = PlannedDrafter([(Oracle(False, "a"), 8), (Oracle(False, "b"), 8)], cost=cost)
    trace, verified = _simulate(planned, 1500, lambda m: [])
    allowance = ALLOWANCE * cost.seconds_for(1)
    for lost, elapsed, window_lost, window_elapsed in trace:
        assert window_lost <= SAFETY * window_elapsed + allowance + 1e-9, (window_lost, window_elapsed)
        # undecayed: the window forgets early losses a little (1500 steps of a 2048-step window)
        assert lost <= 1.5 * SAFETY * elapsed + allowance, (lost, elapsed)
    assert verified >= 10  # explored, within the budget
    report = planned.report()["budget"]
    assert report["trimmed_nodes"] > 0  # drafts were cut to the room left


def test_the_budget_does_not_hold_back_a_drafter_that_pays():
    cost = VerifyCost((1, 65), (1.0, 1.0 + 64 / 3))
    planned = PlannedDrafter([(Oracle(True, "right"), 8)], cost=cost)
    trace, verified = _simulate(planned, 300, lambda m: list(range(m)))
    assert trace[-1][0] < -0.5 * trace[-1][1]  # it saved more than half the time
    assert verified > 8 * 250  # nearly every step verifies the whole draft
    assert planned.report()["budget"]["held_steps"] == 0


def test_held_for_counts_the_plain_steps_until_there_is_room():
    from metaloom.speculative.planner import Budget

    budget = Budget(lost=0.5, elapsed=10.0)
    n = budget.held_for(0.1, 0.05)
    assert n > 0 and budget.held_for(0.1, 1.0) == 0.0  # room already with a larger allowance
    steps = 0
    while budget.room(0.05) <= 0:
        budget.record(0.1)
        steps += 1
    assert steps == pytest.approx(n, abs=1.0)


class Counting(Oracle):
    """An `Oracle` that counts its proposals and observations; ``learns_only``: it declares
    that observing only feeds what it learns."""

    def __init__(self, right, name, learns_only=False):
        super().__init__(right, name)
        self.learns_only = learns_only
        self.proposals = self.observed = 0

    def propose(self, contexts, limits, ledger):
        self.proposals += 1
        return super().propose(contexts, limits, ledger)

    def observe(self, verified):
        self.observed += 1


def _plain_steps(state, n):
    for _ in range(n):
        draft = state.propose([[1, 2, 3]], [8], None)
        assert int(draft.lengths[0]) == 0
        state.observe(Verified(draft=draft, logits=torch.zeros(1, 1, V), accepted=torch.tensor([0]),
                               tokens=torch.tensor([[1]]), pending=torch.tensor([3])))


def test_a_step_the_plan_drafts_nothing_for_asks_no_drafter_and_idle_learners_skip_observing():
    """With the budget spent for longer than `PROBE_EVERY` steps no drafter is asked to propose,
    and a drafter whose observation only feeds its learning (Token Recycling's table) is not fed;
    the others are. With room for a node, the learner is fed every step again, and what its observations
    take is charged to the budget (a drafter that keeps row state is not charged)."""
    drafter, learner = Counting(False, "a"), Counting(False, "b", learns_only=True)
    planned = PlannedDrafter([(drafter, 8), (learner, 8)], cost=STEEP)
    state = planned.start(None, None, [[1, 2, 3]], [0])
    planned.budget.lost = 1000.0  # lost far more than the room: held for thousands of steps
    _plain_steps(state, 20)
    assert drafter.proposals == learner.proposals == 0
    assert drafter.observed == 20 and learner.observed == 0
    planned.reset()  # a fresh budget, and no drafter dropped yet
    planned.budget.lost = -1.0  # earned: room for one node (a step on this curve), where no draft pays
    state = planned.start(None, None, [[1, 2, 3]], [0])
    charged: list[float] = []
    planned.charge = charged.append  # what the budget is charged, as it is charged
    _plain_steps(state, 5)
    assert learner.observed == 5
    assert len(charged) == 5 and all(t > 0 for t in charged)  # the learner's observations, each
    alone = PlannedDrafter([(Counting(False, "c"), 8)], cost=STEEP)  # a drafter that keeps row state: not charged
    alone.charge = charged.append
    _plain_steps(alone.start(None, None, [[1, 2, 3]], [0]), 5)
    assert len(charged) == 5


def test_recycling_learns_from_a_plain_step_as_from_a_one_token_block():
    from metaloom.speculative.drafters.recycling import RecyclingDrafter

    logits = torch.randn(2, 1, 50)
    fast, slow = RecyclingDrafter(), RecyclingDrafter()
    target = type("T", (), {"vocab_size": 50})()
    for d in (fast, slow):
        d.start(target, None, [[0], [0]], [0, 0])
    pending = torch.tensor([7, 9])
    empty = Draft.from_lists([[], []])
    fast.start(target, None, [[0], [0]], [0, 0]).observe(
        Verified(draft=empty, logits=logits, accepted=torch.zeros(2, dtype=torch.long), tokens=pending[:, None],
                 pending=pending))
    slow.learn(pending, logits[:, 0])
    assert torch.equal(fast.table, slow.table) and (fast.table[7] >= 0).all()


def test_a_step_that_verified_nothing_loses_only_its_drafting_not_its_forwards_noise():
    """A drafter asked for tokens that proposes none (prompt lookup without a match) leaves a
    plain step's forward: the budget is charged the drafting alone, however slow the forward ran."""
    planned = PlannedDrafter([(Oracle(True, "right"), 4)], cost=FLAT)
    choice = planned.plan([COLD], [4])
    assert choice.k > 0
    slow = 3 * FLAT.seconds_for(1)  # a forward three times the curve's (another process ran)
    planned.learn(choice, Outcome([COLD], [4], [0], [0], [[]], 0.002, slow, 1))
    assert planned.budget.lost == pytest.approx(0.002)
    assert planned.budget.elapsed == pytest.approx(slow + 0.002)


class Behind(Counting):
    """A right `Counting` drafter that must spend ``seconds`` feeding context before it drafts."""

    def __init__(self, seconds, name="behind"):
        super().__init__(True, name)
        self.seconds = seconds

    def catch_up(self, contexts):
        return self.seconds


def test_plan_defers_a_catch_up_dearer_than_the_room():
    """A catch-up of 0.8 s is more than the fresh budget's room of half a step (a step is 1 s on
    the flat curve, where a verified node costs nothing): the plan drafts nothing and counts a
    deferred step. 0.3 s fits."""
    for seconds, k in ((0.8, 0), (0.3, 4)):
        planned = PlannedDrafter([(Behind(seconds), 4)], cost=FLAT)
        assert planned.plan([COLD], [4], [seconds]).k == k
        assert planned.report()["budget"]["deferred_steps"] == int(k == 0)


@pytest.mark.parametrize("seconds", [0.0, 1e9])
def test_a_catch_up_the_budget_cannot_cover_is_not_started(seconds):
    """In the decode loop: a drafter whose catch-up takes longer than any room the budget can
    have is never asked, every step is plain and counted as deferred; with nothing to feed, the
    same drafter drafts and is accepted."""
    drafter = Behind(seconds)
    planned = PlannedDrafter([(drafter, 4)], cost=FLAT)
    out, usage = _run(Speculative(planned, 4), max_tokens=60)
    assert out == _run(None, max_tokens=60)[0]
    deferred = planned.report()["budget"]["deferred_steps"]
    if seconds:
        # every step but the last, whose one token left allows no draft
        assert drafter.proposals == 0 and usage.accepted_tokens == 0 and deferred == usage.verify_steps - 1
    else:
        assert drafter.proposals > 5 and usage.accepted_tokens > 30 and deferred == 0


def test_a_catch_up_is_weighed_against_the_tokens_still_to_come():
    """The 0.3 s catch-up that fits the fresh room (a step is 1 s on the flat curve) is still not
    started with 4 tokens to come (5% of 4 plain steps is 0.2 s); with 100 to come, or nothing
    known of them, it is."""
    for ahead, k in ((4, 0), (100, 4), (None, 4)):
        planned = PlannedDrafter([(Behind(0.3), 4)], cost=FLAT)
        assert planned.plan([COLD], [4], [0.3], [ahead]).k == k


class Amortised(Behind):
    """`Behind` that knows how many tokens its rows may still produce (a draft model's
    ``ahead``): the request's ``max_tokens`` less what the context has gained since it started."""

    def __init__(self, seconds, max_tokens, name="behind"):
        super().__init__(seconds, name)
        self.max_tokens, self.start_len = max_tokens, None

    def start(self, target, sampler, contexts, keys):
        self.start_len = len(contexts[0])
        return self

    def ahead(self, contexts):
        return self.max_tokens - (len(contexts[0]) - self.start_len)


@pytest.mark.parametrize("amortised", [False, True])
def test_gains_of_one_drafter_do_not_pay_for_a_catch_up_the_rest_of_the_request_cannot(amortised):
    """`auto` with a right drafter, whose accepted drafts bank seconds in the budget, and a right
    one that must first feed 30 s of context: without knowing the tokens to come, the banked
    gains pay for that catch-up once they exceed it (as they did for the 0.5B draft model under
    prompt lookup on Qwen2.5-1.5B); knowing that 400 tokens are at most 400 s of plain steps to
    spread it over (5%: 20 s), it is never started. Greedy's tokens either way."""
    dear = Amortised(30.0, 400) if amortised else Behind(30.0)
    planned = PlannedDrafter([(Counting(True, "lookup"), 8), (dear, 8)], cost=FLAT)
    out, _ = _run(Speculative(planned, 8), max_tokens=400)
    assert out == _run(None, max_tokens=400)[0]
    assert (dear.proposals == 0) == amortised


def test_a_drafter_whose_catch_up_the_request_cannot_pay_for_is_out_of_the_plans():
    """`auto` with a drafter whose catch-up the tokens to come can never pay for, priced first at
    its priors (an untried draft model), and a right one: the right one drafts from the first
    step rather than after a trial 16 steps on (each step deferred for the dear one until then),
    and the dear one is never asked. Greedy's tokens."""
    dear, right = Amortised(1e9, 60), Counting(True, "lookup")
    planned = PlannedDrafter([(dear, 4), (right, 4)], cost=FLAT)
    out, usage = _run(Speculative(planned, 4), max_tokens=60)
    assert out == _run(None, max_tokens=60)[0]
    assert dear.proposals == 0 and right.proposals >= usage.verify_steps - 2
    assert planned.report()["nodes_verified"].get("0", 0) <= 2


class Empty(Counting):
    """Asked for tokens, proposes none (prompt lookup where the context has no match)."""

    def propose(self, contexts, limits, ledger):
        self.proposals += 1
        return Draft.from_lists([[] for _ in contexts])


def test_auto_tries_a_drafter_only_when_its_drafting_fits_the_room():
    """`auto` with a drafter that finds nothing and a right one whose learned drafting time is
    ten seconds: the dear one is due for a trial after 16 steps but never fits the room, so it is
    never asked; the other is."""
    empty, dear = Empty(True, "empty"), Counting(True, "dear")
    planned = PlannedDrafter([(empty, 4), (dear, 4)], cost=FLAT)
    planned.draft_costs[1].record(0, 0.0)
    planned.draft_costs[1].record(2, 10.0)  # as learned on an earlier request
    out, _ = _run(Speculative(planned, 4), max_tokens=120)
    assert out == _run(None, max_tokens=120)[0]
    assert dear.proposals == 0 and empty.proposals > 0


def test_a_draft_models_catch_up_is_the_context_it_has_not_fed_at_its_measured_rate():
    from metaloom.sampling.pipeline import make_sampler
    from metaloom.speculative.drafters.draft_model import DraftModelDrafter

    target, draft = tiny_llama().model, tiny_llama(seed=1).model
    sampler = make_sampler([SamplingParams(temperature=0, max_tokens=8)], target.vocab_size, target.device)
    drafter = DraftModelDrafter(draft)
    assert drafter.start(target, sampler, [[1, 2, 3, 4, 5]], [0]).catch_up([[1, 2, 3, 4, 5]]) == 0.0  # not measured
    rate = drafter.measure_feed()
    assert rate > 0 and drafter.measure_feed() == rate  # measured once
    state = drafter.start(target, sampler, [[1, 2, 3, 4, 5]], [0])
    assert state.catch_up([[1, 2, 3, 4, 5]]) == pytest.approx(5 * rate)  # the whole prompt first
    state.propose([[1, 2, 3, 4, 5]], [2], Ledger())
    assert state.catch_up([[1, 2, 3, 4, 5, 6, 7]]) == pytest.approx(rate)  # fed the prompt and the first draft
    # the tokens a catch-up is spread over: max_tokens (8) less those produced, through select and join
    assert state.ahead([[1, 2, 3, 4, 5]]) == 8 and state.ahead([[1, 2, 3, 4, 5, 6, 7]]) == 6
    two = state.join(drafter.start(target, sampler, [[9, 9]], [1]))
    assert two.ahead([[1, 2, 3, 4, 5, 6], [9, 9, 9, 9, 9]]) == 7
    assert two.select([1]).ahead([[9, 9, 9, 9, 9]]) == 5
    # a draft model drafting trees feeds the same context first: priced and weighed the same
    from metaloom.speculative.drafters.draft_tree import draft_tree_drafter
    from metaloom.speculative.tree import TreeShape

    trees = draft_tree_drafter(draft, TreeShape.parse("static:2,1"))
    assert trees.measure_feed() > 0
    tree = trees.start(target, sampler, [[1, 2, 3]], [0])
    assert tree.catch_up([[1, 2, 3]]) == pytest.approx(3 * trees.feed[0]) and tree.ahead([[1, 2, 3, 4]]) == 7


def test_the_planner_measures_a_draft_models_feed_rate_before_any_request_pays_for_it():
    """Given a measured verify cost, the planner measures the draft model's feed rate when it is
    built (no request's steps pay for it); without one, both when it first starts."""
    from metaloom.sampling.pipeline import make_sampler
    from metaloom.speculative.drafters.draft_model import DraftModelDrafter

    target = tiny_llama().model
    sampler = make_sampler([SamplingParams(temperature=0, max_tokens=8)], target.vocab_size, target.device)
    drafter = DraftModelDrafter(tiny_llama(seed=1).model)
    planned = PlannedDrafter([(drafter, 4)], cost=FLAT)
    assert drafter.feed  # at construction
    state = planned.start(target, sampler, [[1, 2, 3]], [0])
    assert state.states[0].catch_up([[1, 2, 3]]) == pytest.approx(3 * drafter.feed[0])
    lazy = DraftModelDrafter(tiny_llama(seed=1).model)
    planned = PlannedDrafter([(lazy, 4)])
    assert not lazy.feed
    planned.start(target, sampler, [[1, 2, 3]], [0])
    assert lazy.feed and planned.cost is not None


def test_a_drafter_is_not_asked_when_the_room_cannot_hold_one_verified_node():
    """A verified node costs 0.4 of a step (worth it at the prior's 0.5 acceptance). With 0.3 of
    a step of room, `afford` would verify none of whatever is drafted, so the drafter is not
    asked and the step counts as deferred; with the fresh budget's half step, it is asked."""
    planned = PlannedDrafter([(Counting(True, "right"), 4)], cost=NODE_04)
    planned.budget.lost = 0.2  # room: half a step less 0.2
    assert planned.plan([COLD], [4]).k == 0 and planned.report()["budget"]["deferred_steps"] == 1
    planned.budget.lost = 0.0
    assert planned.plan([COLD], [4]).k == 4


def test_a_learner_is_idle_while_the_room_cannot_hold_one_node_for_long():
    """Token Recycling's table update is charged to the budget: while the room stays under one
    verified node's time (0.4 of a step here) for more than `PROBE_EVERY` steps, no draft of it
    can come, so it is idle (it would otherwise keep the budget from ever reaching that node)."""
    planned = PlannedDrafter([(Counting(True, "a", learns_only=True), 4), (Counting(True, "b"), 4)], cost=NODE_04)
    planned.budget.elapsed, planned.budget.lost = 10.0, 0.45  # room 0.1 + 0.5 - 0.45: 0.25 short of a node
    assert planned.idle(0)  # about 25 plain steps to earn it, at 1% of each
    planned.budget.lost = 0.1  # room 0.5: a node fits
    assert not planned.idle(0)


def test_a_learner_is_idle_while_the_room_cannot_hold_its_drafting_with_a_node():
    """The room holds a node but not the learner's drafting with it: `plan` defers each of its
    steps, while its charged observations keep the room short (Token Recycling on SmolLM2's free
    prompts: 94-111 deferred steps a request, its drafts never verified). It idles until the room
    holds both."""
    planned = PlannedDrafter([(Counting(True, "a", learns_only=True), 4)], cost=NODE_04)
    planned.draft_costs[0].record(0, 0.0)
    for k in (1, 4):
        planned.draft_costs[0].record(k, 0.3)  # 0.3 s a call, whatever its length
    planned.budget.elapsed, planned.budget.lost = 10.0, 0.15  # room 0.1 + 0.5 - 0.15: a node (0.4) and 0.05
    assert planned.plan([COLD], [4]).k == 0 and planned.report()["budget"]["deferred_steps"] == 1
    assert planned.idle(0)
    planned.budget.lost = -0.3  # room 0.9: the node and the drafting
    assert not planned.idle(0) and planned.plan([COLD], [4]).k > 0


def test_a_lone_learner_the_budget_holds_stops_learning_until_a_node_comes_near():
    """Token Recycling alone: once the budget cannot hold one verified node for longer than
    `PROBE_EVERY` steps, its observations (charged every step) stop, so that the budget can earn
    the node back; with the node in reach again it learns from every step."""
    learner = Counting(True, "a", learns_only=True)
    planned = PlannedDrafter([(learner, 8)], cost=STEEP)
    state = planned.start(None, None, [[1, 2, 3]], [0])
    planned.budget.lost = 1000.0  # held for thousands of steps
    _plain_steps(state, 10)
    assert learner.proposals == 0 and learner.observed == 0
    planned.budget.lost = -1.0  # room for a node again
    learner.observed = 0
    planned.plan = lambda hot, limits, catch_up=None, ahead=None: Choice(0, 0, False, False, 0.0)  # a plain step all the same
    _plain_steps(state, 4)
    assert learner.observed == 4


def test_a_drafted_steps_overhead_prices_only_steps_that_verify_a_node():
    cost = VerifyCost((1, 2, 3, 4, 5), (1.0, 1.1, 1.2, 2.0, 2.2))
    a = np.array([0.9, 0.8, 0.7, 0.6])
    # without it the best is two nodes (2.7 / 1.2); with 0.5 of a step more for any drafted step:
    # 1 / 1 against 1.9 / 1.6, 2.7 / 1.7 (best), 3.4 / 2.5, 4.0 / 2.7
    assert prune([a], [4], 1, Timing(cost, 1.0, 0.0, 0.5)) == [2]
    assert prune([a], [4], 1, Timing(cost, 1.0, 0.0, 1.8)) == [0]  # 2.7 / 3.0 < 1: no draft pays it
    timing = Timing(cost, 1.0, 0.25, 0.5)
    assert [timing.drafted_at(1, n) for n in (0.0, 0.5, 2.0)] == pytest.approx([1.25, 1.05 + 0.25 + 0.25, 1.2 + 0.75])
    assert timing.node(1) == pytest.approx(0.1 + 0.5)
    # plan_length sees it too: a certain 1-token draft (0.1 to draft) yields 2 tokens in 1.1 + 0.1 + 0.5 (1.18
    # a second, over 1), in 1.1 + 0.1 + 1.0 with twice the overhead (0.91: plain steps pay more)
    dear = DraftCost(per_token=0.1)
    assert plan_length([np.ones(1)], [np.ones(1)], [1], 1, Timing(cost, 1.0, 0.0, 0.5), dear, 1)[0] == 1
    assert plan_length([np.ones(1)], [np.ones(1)], [1], 1, Timing(cost, 1.0, 0.0, 1.0), dear, 1)[0] == 0


def test_the_overhead_is_learned_from_drafted_steps_and_the_scale_from_plain_ones():
    """The overhead is the median of the last drafted steps' times beyond scale * c(width): a
    stall does not move it, a faster-than-priced step pulls it down but never below 0."""
    planned = PlannedDrafter([(Oracle(True, "right"), 4)], cost=VerifyCost((1, 5), (0.01, 0.02)))
    planned.start(None, None, [[0]], [0])
    planned.step = 5
    scale = planned.scale
    drafted = Choice(0, 4, False, False, 0.0)

    def step(beyond):  # a step verifying 2 nodes (width 3: 0.015 s priced) that took ``beyond`` more
        planned.learn(drafted, Outcome([COLD], [4], [4], [2], [[0, 1]], 0.0, planned.scale * 0.015 + beyond, 3))

    step(0.003)
    assert planned.overhead == pytest.approx(0.003) and planned.scale == scale
    step(0.005)
    step(1.0)  # a stall
    assert planned.overhead == pytest.approx(0.005)
    step(-0.004)
    step(-0.004)
    step(-0.004)
    assert planned.overhead == 0.0  # the median is -0.004 + ... < 0: priced at 0
    before = planned.overhead = 0.002
    plain = Choice(0, 0, False, False, 0.0)
    planned.learn(plain, Outcome([COLD], [0], [0], [0], [[]], 0.0, 0.02, 1))  # a plain step twice its price
    assert planned.overhead == before and planned.scale == pytest.approx(scale + 0.2 * (2.0 - scale))
    assert planned.report()["overhead_ms"] == 2.0 and planned.timing().overhead == before
    for _ in range(16):  # the window: only the last 16 drafted steps count
        step(0.001)
    assert planned.overhead == pytest.approx(0.001)


def test_fit_overhead_separates_a_fixed_part_from_a_share_of_the_width():
    """Drafted steps whose seconds beyond the table are 0.5 + 0.3 x (x: the table's seconds the
    nodes add) give back both parts exactly; a 30 ms stall among eight steps moves neither; steps
    of one width (or widths closer than ``apart``), or fewer than `WIDE_POINTS` steps, carry no
    slope, and their median is the overhead."""
    points = [(x, 0.5 + 0.3 * x) for x in (0.1, 0.1, 0.5, 1.0, 1.0, 2.5, 4.0, 4.0)]
    assert len(points) == WIDE_POINTS
    assert fit_overhead(points, 0.05) == pytest.approx((0.5, 0.3))
    assert fit_overhead([*points, (1.0, 30.0)], 0.05) == pytest.approx((0.5, 0.3))
    assert fit_overhead(points[1:], 0.05) == pytest.approx((0.5 + 0.3 * 1.0, 0.0))  # 7: the median of r
    assert fit_overhead([(1.0, 0.2), (1.0, 0.4), (1.0, 9.0)], 0.05) == pytest.approx((0.4, 0.0))
    assert fit_overhead([(1.0, 0.2), (1.02, 0.4), (1.0, 9.0)], 0.05) == pytest.approx((0.4, 0.0))
    assert fit_overhead([], 0.05) == (0.0, 0.0)


def test_the_width_share_prices_wide_verifies_above_narrow_ones():
    """One additive overhead fitted to wide steps overprices a narrow draft; split into a fixed
    part and a share of the width, the same steps' costs price a one-node draft below it."""
    cost = VerifyCost((1, 2, 6), (1.0, 1.1, 1.5))
    timing = Timing(cost, 1.0, 0.0, 0.1, 0.5)  # a drafted step: + 0.1, + half the width's table seconds
    # nodes 0, 1, 5: 1.0; 1.1 + 0.1 + 0.05; 1.5 + 0.1 + 0.25
    assert [timing.drafted_at(1, n) for n in (0.0, 1.0, 5.0)] == pytest.approx([1.0, 1.25, 1.85])
    assert timing.node(1) == pytest.approx(0.1 * 1.5 + 0.1)
    # a node accepted 0.3 of the time: 1.3 / 1.25 > 1 pays; with one overhead of 0.35, which the same
    # 5-node steps' 0.35 beyond the table would give, 1.3 / 1.45 < 1 does not
    a = np.array([0.3])
    assert prune([a], [1], 1, timing) == [1]
    assert prune([a], [1], 1, Timing(cost, 1.0, 0.0, 0.35)) == [0]


def test_the_planner_learns_both_parts_from_drafted_steps_of_two_widths():
    cost = VerifyCost((1, 2, 6), (0.010, 0.011, 0.015))
    planned = PlannedDrafter([(Oracle(True, "right"), 5)], cost=cost)
    planned.start(None, None, [[0]], [0])
    planned.step = 5
    drafted = Choice(0, 5, False, False, 0.0)

    def step(nodes):  # a step verifying ``nodes`` that took 2 ms + 0.5 of the width's table time more
        width = 1 + nodes
        took = planned.scale * cost.seconds_for(width) + 0.002 + 0.5 * (cost.seconds_for(width) - 0.010)
        planned.learn(drafted, Outcome([COLD], [5], [5], [nodes], [[0]], 0.0, took, width))

    for nodes in (1, 5, 1, 5, 1, 5, 1):
        step(nodes)
    assert planned.wide == 0.0  # 7 steps: their median residual (a 2-token step's) is the overhead
    assert planned.overhead == pytest.approx(0.002 + 0.5 * 0.001)
    step(5)
    assert (planned.overhead, planned.wide) == pytest.approx((0.002, 0.5))
    assert planned.timing().wide == planned.wide and planned.report()["overhead_wide"] == 0.5


def test_held_for_counts_what_learning_charges_every_step():
    from metaloom.speculative.planner import Budget

    budget = Budget(lost=0.5, elapsed=10.0)
    plain, paying = budget.held_for(0.1, 0.05), budget.held_for(0.1, 0.05, spend=0.0005)
    assert paying > plain > 0
    steps = 0
    while budget.room(0.05) <= 0:  # a plain step of 0.1 s, then 0.5 ms of learning charged
        budget.record(0.1)
        budget.charge(0.0005)
        steps += 1
    assert steps == pytest.approx(paying, abs=1.0)
    assert Budget(lost=0.5, elapsed=10.0).held_for(0.1, 0.05, spend=0.002) == float("inf")  # 1% of 0.1 s < 2 ms


def test_a_learner_whose_learning_costs_more_than_the_budget_earns_is_idle():
    """The room is a few plain steps short of a node, but the learner's own charges (twice what
    a plain step earns) would keep it short for ever: it idles, and learns again when the room
    holds the node."""
    planned = PlannedDrafter([(Counting(True, "a", learns_only=True), 4), (Counting(True, "b"), 4)], cost=NODE_04)
    planned.budget.elapsed, planned.budget.lost = 10.0, 0.21  # room 0.1 + 0.5 - 0.21: 0.01 short of a node
    assert not planned.idle(0)  # a plain step earns 0.01
    state = planned.start(None, None, [[1, 2, 3]], [0])
    planned.plan = lambda hot, limits, catch_up=None, ahead=None: Choice(0, 0, False, False, 0.0)
    planned.charge(0.02)  # what its last observation cost: twice a step's earnings
    _plain_steps(state, 1)
    assert planned.spend == pytest.approx(0.02) and planned.report()["learning_ms"] == 20.0
    assert planned.idle(0)
    planned.budget.lost = 0.0  # room for the node
    assert not planned.idle(0)


def test_plain_ahead_promises_the_steps_the_budget_holds_but_the_last():
    planned = PlannedDrafter([(Oracle(False, "a"), 4)], cost=NODE_04)
    assert planned.plain_ahead(1) == 0  # a fresh budget has room for a node
    planned.budget.elapsed, planned.budget.lost = 10.0, 0.45  # room 0.15: 0.25 short of a node (0.4)
    timing = planned.timing()
    held = planned.budget.held_for(timing.seconds(1), planned.allowance() - timing.node(1))
    assert held > 2 and planned.plain_ahead(1) == int(held) - 1
    planned.budget.lost = 1e6
    assert planned.plain_ahead(1) == 63  # at most `AHEAD_MOST` before asking again
    assert PlannedDrafter([(Oracle(False, "a"), 4)]).plain_ahead(1) == 0  # no verify cost yet
    planned.skipped(0.5, 1)  # learned as an undrafted step: counted, in the budget, in the report
    report = planned.report()
    assert report["steps"] == 1 and report["plain_ahead_steps"] == 1 and report["nodes_verified"] == {"0": 1}
    assert planned.budget.elapsed == pytest.approx(10.0 * (1 - 1 / 2048) + 0.5)


def test_plain_ahead_waits_for_every_learner_to_idle():
    learner = Counting(True, "a", learns_only=True)
    planned = PlannedDrafter([(learner, 4), (Counting(True, "b"), 4)], cost=NODE_04)
    state = planned.start(None, None, [[1, 2, 3]], [0])
    planned.budget.elapsed, planned.budget.lost = 10.0, 0.45  # about 25 plain steps from a node
    planned.spend = 0.0005  # its learning costs less than a step earns
    assert planned.idle(0) and state.plain_ahead(1)  # ~25 steps away: idle, and the steps are plain
    planned.budget.lost = 0.25  # 0.05 short: about 5 steps, the planner sure of 4
    state.ahead = 0
    assert planned.plain_ahead(1) >= 3
    assert not planned.idle(0) and not state.plain_ahead(1)  # the learner is not idle: it learns from them


def test_steps_the_budget_holds_run_without_the_drafters():
    """A drafter nothing of which is accepted, on a curve where each verified token costs a whole
    step: the budget holds it, and those steps run as plain steps it neither plans nor observes,
    counted as the speculative decoder's steps all the same; the tokens are greedy's."""
    drafter = Counting(False, "wrong")
    planned = PlannedDrafter([(drafter, 8)], cost=STEEP)
    tokens, usage = _run(Speculative(planned, 8))
    assert tokens == _run(None)[0]
    report = planned.report()
    assert report["plain_ahead_steps"] > 100 and report["steps"] == usage.verify_steps == 199  # the prefill drew the 1st
    assert drafter.observed == report["steps"] - report["plain_ahead_steps"]


def test_a_lone_drafter_none_of_whose_drafts_pays_runs_plain_steps_until_its_probe():
    """On a curve where each verified token costs a whole step, a drafter nothing of which is
    accepted stops being asked once its estimates say no draft pays, with room left in the
    budget: the steps until its next probe run plain, without planning or observing (but the
    last, which its drafter observes), the probes still come, and the tokens are greedy's."""
    drafter = Counting(False, "wrong")
    planned = PlannedDrafter([(drafter, 8)], cost=STEEP)
    planned.budget.elapsed = 1e6  # room for every probe: the budget holds nothing here
    tokens, usage = _run(Speculative(planned, 8))
    assert tokens == _run(None)[0]
    report = planned.report()
    assert report["budget"]["held_steps"] == 0
    assert report["plain_ahead_steps"] > 100 and report["steps"] == usage.verify_steps == 199
    assert drafter.observed == report["steps"] - report["plain_ahead_steps"]
    assert report["drafters"]["wrong"]["steps"] >= 3  # its probes: one at each due step
    # right after a plan that asked nothing, the promise reaches to the step before the next probe's
    # (one more node, or a trial of its planned length), the last of those steps not counted
    state = planned.start(None, None, [[1, 2, 3]], [0])
    state.ahead = 0
    _plain_steps(state, 1)
    due = planned.quiet_until
    assert due in (planned.extras[0].last + planned.extras[0].interval, planned.probes[0].last + planned.probes[0].interval)
    assert due > planned.step + 2 and planned.plain_ahead(1) == min(due - planned.step - 1, 64) - 1
