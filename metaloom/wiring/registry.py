"""The edge where names meet classes: every strategy, and every component a strategy can be
configured with (scorers, answer extractors, MBR utilities, refinement feedback), by name.

The CLI, server and evaluation configs look names up here; library code passes objects.
Entries are classes or factory functions whose parameters (dataclass fields or signature)
are what ``metaloom run --strategy.PARAM`` accepts. Entries given as ``"module:attribute"``
strings are imported when first used, so optional dependencies (transformers for reward
models, the sandbox, sacrebleu) load only when named.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.meta.adaptive_vote import AdaptiveVote
from metaloom.meta.best_of_n import BestOfN
from metaloom.meta.budget_forcing import BudgetForcing
from metaloom.meta.chain import Chain
from metaloom.meta.first_finish import FirstFinish
from metaloom.meta.mbr import MBR
from metaloom.meta.pruned import PrunedBestOfN
from metaloom.meta.refine import Refine
from metaloom.meta.single import Single
from metaloom.meta.types import Strategy
from metaloom.meta.vote import MajorityVote, WeightedVote
from metaloom.score.answers import ChoiceLetter, ExactString, Extractor, LastNumber, MathAnswer
from metaloom.score.feedback import CritiqueFeedback, Feedback, FunctionFeedback, ScorerFeedback
from metaloom.score.logprob import SequenceLogprob
from metaloom.score.protocols import Scorer, StepScorer, Utility
from metaloom.search.a_star import AStar
from metaloom.search.beam import DVTS, StepBeamSearch
from metaloom.search.best_first import BestFirst
from metaloom.search.lookahead import Lookahead
from metaloom.search.mcts import MCTS
from metaloom.search.particle import ParticleFiltering
from metaloom.search.rebase import Rebase

Entry = Callable[..., Any] | str

STRATEGIES: dict[str, Entry] = {
    "greedy": Single,  # one output (greedy by default): the baseline of every curve
    "chain": Chain,
    "best_of_n": BestOfN,
    "majority_vote": MajorityVote,
    "weighted_vote": WeightedVote,
    "mbr": MBR,
    "refine": Refine,
    "budget_forcing": BudgetForcing,
    "tool_chain": "metaloom.meta.tool_chain:ToolChain",  # ReAct: think, call a tool, observe (metaloom.tools)
    "adaptive_vote": AdaptiveVote,
    "first_finish": FirstFinish,
    "pruned_best_of_n": PrunedBestOfN,
    "spec_reason": "metaloom.meta.spec_reason:SpecReason",  # a small model drafts, the large judges
    # tree search over reasoning steps (`metaloom.search`)
    "step_beam_search": StepBeamSearch,
    "dvts": DVTS,
    "lookahead": Lookahead,
    "rebase": Rebase,
    "mcts": MCTS,
    "a_star": AStar,
    "particle_filtering": ParticleFiltering,
    "entropic_particle_filtering": "metaloom.search.entropic:EntropicParticleFiltering",
    "best_first": BestFirst,
    "refine_tree": "metaloom.search.refine_tree:RefineTree",  # AlphaVerus treefinement
}

SCORERS: dict[str, Entry] = {
    "logprob": SequenceLogprob,
    "reward_model": "metaloom.score.reward_model:RewardModel.load",
    "judge": "metaloom.score.judge:LLMJudge",
    "verifier": "metaloom.score.verifier:FunctionVerifier",
    "execution": "metaloom.score.execution:ExecutionScorer",
    # exact final-answer checkers of reasoning-gym's puzzles
    "countdown": "metaloom.score.puzzles:CountdownAnswer",
    "game24": "metaloom.score.puzzles:Game24Answer",
    # the problem's docstring examples (metaloom eval on humaneval): the fraction a candidate passes
    "public_tests": "metaloom.score.public_tests:public_tests_scorer",
}

# scorers of partial solutions, for tree search (``--strategy.step_scorer NAME``)
STEP_SCORERS: dict[str, Entry] = {
    "prm": "metaloom.score.prm:ProcessRewardModel.load",
    "judge": "metaloom.score.step_judge:StepJudge",
    "rollout": "metaloom.score.rollout:RolloutValue",
    "countdown": "metaloom.score.puzzles:CountdownSteps",
    "game24": "metaloom.score.puzzles:Game24Steps",
}

EXTRACTORS: dict[str, Entry] = {
    "math": MathAnswer,
    "last_number": LastNumber,
    "choice": ChoiceLetter,
    "exact": ExactString,
    "code_tests": "metaloom.score.answers:execution_outcomes",
}

FEEDBACK: dict[str, Entry] = {
    "critique": CritiqueFeedback,
    "verifier": ScorerFeedback,
    "function": FunctionFeedback,
    "tests": "metaloom.score.feedback:ExecutionFeedback",
    "public_tests": "metaloom.score.public_tests:public_tests_feedback",  # the problem's examples (metaloom eval)
}

# MBR utilities: the library of `metaloom.score.utility` plus the pairwise LLM judge
UTILITY_MODULE = "metaloom.score.utility"
JUDGE_UTILITY: dict[str, Entry] = {"judge": "metaloom.score.judge:PairwiseJudge"}


def utilities() -> dict[str, Entry]:
    """Utility names -> entries (the utility library is imported on first use)."""
    try:
        module = importlib.import_module(UTILITY_MODULE)
    except ImportError:
        return dict(JUDGE_UTILITY)
    found: Mapping[str, Entry] = getattr(module, "UTILITIES", {})
    return {**found, **JUDGE_UTILITY}


def resolve(entry: Entry) -> Callable[..., Any]:
    """A registry entry as a callable (imports ``"module:attr.attr"`` entries)."""
    if not isinstance(entry, str):
        return entry
    module, _, path = entry.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def lookup(kind: str, table: Mapping[str, Entry], name: str) -> Callable[..., Any]:
    if name not in table:
        raise InvalidParameter(kind, name, f"one of {sorted(table)}")
    return resolve(table[name])


def make_utility(name: str, **kwargs: Any) -> Utility:
    return lookup("utility", utilities(), name)(**kwargs)


# which registry fills a parameter of each component type (used by `metaloom.wiring.configure`)
KINDS: dict[Any, tuple[str, Callable[[], Mapping[str, Entry]]]] = {
    Strategy: ("strategy", lambda: STRATEGIES),
    Scorer: ("scorer", lambda: SCORERS),
    StepScorer: ("step_scorer", lambda: STEP_SCORERS),
    Extractor: ("extractor", lambda: EXTRACTORS),
    Utility: ("utility", utilities),
    Feedback: ("feedback", lambda: FEEDBACK),
}
