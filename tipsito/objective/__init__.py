"""The training objective: recipes, the training model, the feature pass and the table of loss terms.

Layout: `recipes.py` (what a recipe is; the registry), `model.py` (`TrainModel`, every trainable part),
`context.py` (`LossContext`, the iBOT mask decision), `features.py` (the one feature pass),
`terms.py` (one function per loss term; `TERMS`), `compute.py` (`compute_losses`, `init_centers`),
`accumulate.py` (exact gradient accumulation over micro-batches).
"""

from tipsito.objective.compute import compute_losses, init_centers
from tipsito.objective.context import LossContext, masks_student_view
from tipsito.config.recipes import EMA_MODES, RECIPES, Recipe, get_recipe
from tipsito.objective.terms import TERMS

__all__ = [
  "RECIPES",
  "get_recipe",
  "Recipe",
  "EMA_MODES",
  "LossContext",
  "masks_student_view",
  "compute_losses",
  "init_centers",
  "TERMS",
]
