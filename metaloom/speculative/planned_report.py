"""What a `metaloom.speculative.planned.PlannedDrafter` measured and chose, as ``--json``'s
``cost_model``: the verify cost, the step's scale and overheads, the budget's record, the nodes
verified per step and each drafter's steps, drafting times and acceptance estimates."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metaloom.speculative.acceptance import COLD, HOT

if TYPE_CHECKING:
    from metaloom.speculative.planned import PlannedDrafter


def planned_report(p: PlannedDrafter) -> dict[str, Any]:
    """``p``'s report (the caller holds its lock)."""
    out: dict[str, Any] = {"drafter": p.name, "verify_cost": None if p.cost is None else p.cost.to_dict(),
                           "scale": round(p.scale, 3), "gap_ms": round(p.gap * 1e3, 3), "steps": p.step,
                           "overhead_ms": round(p.overhead * 1e3, 3), "overhead_wide": round(p.wide, 3),
                           "learning_ms": round(p.spend * 1e3, 3), "plain_ahead_steps": p.ahead_steps,
                           "budget": {"held_steps": p.budget.held, "trimmed_nodes": p.budget.trimmed,
                                      "deferred_steps": p.budget.deferred,
                                      "lost_ms": round(p.budget.lost * 1e3, 3),
                                      "elapsed_ms": round(p.budget.elapsed * 1e3, 3)},
                           "nodes_verified": {str(k): v for k, v in sorted(p.histogram.items())},
                           "drafters": {}}
    for c, d in enumerate(p.drafters):
        acc = p.acceptance[c]
        out["drafters"][d.name] = {
            "most": p.caps[c], "steps": p.steps[c], "verified": p.verified[c], "kept": p.kept[c],
            "draft_ms": {"fixed": round(p.draft_costs[c].fixed * 1e3, 3), "call": round(p.draft_costs[c].call * 1e3, 3),
                         "per_token": round(p.draft_costs[c].per_token * 1e3, 3)},
            "acceptance_hot": [round(float(a), 3) for a in acc.kept_rates(HOT)[:8]],
            "acceptance_cold": [round(float(a), 3) for a in acc.kept_rates(COLD)[:8]]}
    return out
