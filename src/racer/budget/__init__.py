"""How much of a draft to verify: pure Python, except calibration.py, which times the model."""

from racer.budget.acceptance import AcceptanceModel, evidence_levels
from racer.budget.cost import CostModel
from racer.budget.selection import CostCurve, DraftBudget, WholeTree, best_subtree, path_probabilities

__all__ = ["AcceptanceModel", "CostCurve", "CostModel", "DraftBudget", "WholeTree", "best_subtree",
           "evidence_levels", "path_probabilities"]
