"""How much of a draft to verify: pure Python, no torch; the engine times the model for it."""

from racer.budget.acceptance import AcceptanceModel, evidence_levels
from racer.budget.batch import BatchBudget
from racer.budget.cost import CostModel
from racer.budget.selection import (Budget, CostCurve, DraftBudget, StepTiming, WholeTree, best_subtree,
                                    path_probabilities, ranked)

__all__ = ["AcceptanceModel", "BatchBudget", "Budget", "CostCurve", "CostModel", "DraftBudget", "StepTiming",
           "WholeTree", "best_subtree", "evidence_levels", "path_probabilities", "ranked"]
