"""Recipe registry: `config.recipe` -> `Recipe` (which parts exist, which losses with which weights).

Why a registry of plain data: the train loop, `info`, `bench` and config validation all look recipes up by
name, and a new recipe is one small module plus one line here — the loop is never forked.
"""
from tipsito.recipes import clip, distill, ito, siglip, tips, tipsito, tipsv2
from tipsito.recipes.base import ALL_TERMS, EMA_MODES, LossContext, Recipe, compute_losses

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    clip.RECIPE, siglip.RECIPE, ito.RECIPE, tips.RECIPE, tipsv2.RECIPE, tipsito.RECIPE, distill.RECIPE)}


def get_recipe(name: str) -> Recipe:
  """Looks a recipe up by name; the error lists the valid names."""
  if name not in RECIPES:
    raise ValueError(f"config.recipe={name!r} is not a recipe; valid values: {sorted(RECIPES)}")
  return RECIPES[name]


__all__ = ["RECIPES", "get_recipe", "Recipe", "LossContext", "compute_losses", "ALL_TERMS", "EMA_MODES"]
