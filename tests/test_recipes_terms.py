"""The term table and the iBOT mask decision: plain data checks, no compile.

Why: `compute_losses` runs whatever `TERMS` says; a recipe naming a term the table lacks would silently
train without it, and the mask decision must be the same for the model's mask token and the loss.
"""

import dataclasses

import ml_collections as mlc
import pytest

from tipsito import objective
from tipsito.objective import features, terms


def test_every_recipe_term_is_in_the_table():
  for recipe in objective.RECIPES.values():
    assert set(recipe.terms) <= set(objective.TERMS), recipe.name


def test_term_table_names_known_features_and_centres():
  known = {
    features.CAPTION,
    features.SYNTHETIC_CAPTION,
    features.CONTRASTIVE_VIEW,
    features.STUDENT_MASK,
    features.VIEW2,
    features.TEACHER,
    features.LOCAL_CROPS,
    features.PATCH_TOKENS,
    features.CAPTION_TOKENS,
  }
  for name, term in objective.TERMS.items():
    assert term.features <= known, name
    assert "image" in term.fields or "image2" in term.fields, name
  assert [n for n, t in objective.TERMS.items() if t.centers] == [terms.DINO, terms.IBOT]


def test_missing_batch_field_names_the_term():
  ctx = objective.LossContext(**{f.name: None for f in dataclasses.fields(objective.LossContext)})
  ctx = dataclasses.replace(ctx, weights={terms.CLIP_VIEW2: 0.5})
  with pytest.raises(KeyError, match=r"'clip_view2' needs batch fields \['image2'\]"):
    objective.compute_losses(ctx, {}, {}, {}, {}, {"image": None, "text": None}, 0, None)


@pytest.mark.parametrize("ratio,token,want", [(0.75, True, True), (0.0, True, False), (0.75, False, False)])
def test_masks_student_view(ratio, token, want):
  c = mlc.ConfigDict(dict(input=dict(mask_ratio=ratio), model=dict(image=dict(use_mask_token=token))))
  assert objective.masks_student_view(c) is want


@pytest.mark.parametrize(
  "term,flag,field",
  [(terms.IBOT, "masks_student_view", "mask"), (terms.DINO, "has_local_crops", "local_crops")],
)
def test_term_needs_its_run_dependent_field(term, flag, field):
  """A tipsv2 batch without its iBOT mask (or multi-crop batch without its local crops) is refused by
  the field's name: read with a fallback, iBOT would quietly score every patch (iBOT++) and DINO would
  lose its local views."""
  ctx = objective.LossContext(**{f.name: None for f in dataclasses.fields(objective.LossContext)})
  ctx = dataclasses.replace(ctx, weights={term: 1.0}, masks_student_view=False, has_local_crops=False)
  assert field not in objective.TERMS[term].required_fields(ctx)
  ctx = dataclasses.replace(ctx, **{flag: True})
  assert field in objective.TERMS[term].required_fields(ctx)
  with pytest.raises(KeyError, match=rf"{term!r} needs batch fields \[{field!r}\]"):
    objective.compute_losses(ctx, {}, {}, {}, {}, {"image": None, "text": None}, 0, None)
