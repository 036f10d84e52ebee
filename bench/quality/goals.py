"""What a task's figures are asked to reach: each task (sorting.py, code_task.py, package_task.py)
declares its own `Goals`, and figures.goals judges the chains against them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Goals:
    """What a size's figures were asked to reach."""

    name: str
    """Who asked, for what."""
    tau_at_least: float
    over_prompt_lookup_at_least: float
    tree_budget: int = 64
    """The node budget of the draft trees it judges against the chain: a size decodes them beside its own
    (sizes.Size.tree_budgets), unless they cost too much at that size (then 'not measured')."""
    trees_over_chain_at_least: float | None = None
    """The trees of `tree_budget` nodes over the chain, at least (None: reported, not a goal)."""
