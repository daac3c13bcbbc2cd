"""Meta-generators: strategies that call a `Generator` many times and use outside
information (scorers, verifiers, feedback). A strategy never touches a tensor.

Names -> classes live in `metaloom.wiring.registry` (the edge, above meta and search);
library users import the classes directly.
"""

from metaloom.meta.adaptive_vote import AdaptiveVote
from metaloom.meta.best_of_n import BestOfN
from metaloom.meta.budget_forcing import BudgetForcing
from metaloom.meta.chain import Chain
from metaloom.meta.first_finish import FirstFinish
from metaloom.meta.mbr import MBR
from metaloom.meta.pruned import PrunedBestOfN
from metaloom.meta.refine import Refine
from metaloom.meta.types import Event, Result, Strategy
from metaloom.meta.vote import MajorityVote, WeightedVote

__all__ = ["MBR", "AdaptiveVote", "BestOfN", "BudgetForcing", "Chain", "Event", "FirstFinish", "MajorityVote",
           "PrunedBestOfN", "Refine", "Result", "Strategy", "WeightedVote"]
