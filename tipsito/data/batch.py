"""The batch, declared: its field names, the layout a config gives a training batch, and its shapes.

Why a module of its own: the batch is a contract between the code that fills it (tipsito/data/pipeline.py
and the grain operations of tipsito/data/grain_ops.py, or tipsito/data/synthetic.py without a dataset)
and every reader (the objective's feature passes, tipsito/objective/terms.py's `TERMS`, the planner
tipsito/planning/pod.py, the benchmarks). The names are constants here, the views string is decoded once
(`tipsito.choices.view_layout`), and `shape_spec` gives the shapes the planner compiles against, so a
new field is declared in one file and read by name everywhere else (tests/test_import_structure.py fails
on a field name written as a string key outside this module and the pipelines that fill the batches).

One training example holds (B = the batch, per host or global):

  IMAGE        (B, S, S, 3) uint8   the global crop (view 1): the student's view and the teacher's
                                    unmasked view, S = `config.input.global_size`
  IMAGE2       (B, S, S, 3) uint8   ITO's second global view (views with two global views)
  LOCAL_CROPS  (B, M, s, s, 3) uint8  multi-crop's M = `config.input.num_local` local crops,
                                    s = `config.input.local_size`
  MASK         (B, g, g) bool       the iBOT mask on the global crop's patch grid (g = ceil(S / patch)),
                                    when `config.input.mask_ratio` > 0; True = masked
  TEXT         (B, L) int32         the alt-text's token ids (CLS1's caption), L = `config.max_len`
  TEXT2        (B, L) int32         a synthetic caption's token ids (CLS2's caption; the alt-text when
                                    the record has none)
  LABEL        (B,) int32           the record's class when `config.data.label_key` is set; no loss
                                    term reads it, so the step's shape spec leaves it out

The evaluation batches (tipsito/data/eval_input.py) share IMAGE and LABEL with it and add SEGMENTATION,
DEPTH, CAPTIONS and VALID (see below); their shapes depend on each evaluator, so `shape_spec` is the
training batch's only.

Light on purpose: numpy and the enumerations only; JAX is imported inside `shape_spec`, the one function
that returns its types.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import numpy as np

from tipsito.choices import ViewLayout, view_layout
from tipsito.data import masking

IMAGE = "image"
IMAGE2 = "image2"
LOCAL_CROPS = "local_crops"
MASK = "mask"
TEXT = "text"
TEXT2 = "text2"
LABEL = "label"
# The evaluation batches (tipsito/data/eval_input.py: `read_example`, `eval_batches`) hold IMAGE (at the
# eval's size) and, as the evaluator asks, LABEL and:
SEGMENTATION = "segmentation"  # (B, S, S) uint8 label map
DEPTH = "depth"  # (B, S, S) float32 depth in metres
CAPTIONS = "captions"  # per example, a list of str
VALID = "_valid"  # (B,) bool: a real example, not the padding of a last batch
# Every field name (tests/test_import_structure.py reads this tuple: keep it a tuple of the names above).
FIELDS = (IMAGE, IMAGE2, LOCAL_CROPS, MASK, TEXT, TEXT2, LABEL, SEGMENTATION, DEPTH, CAPTIONS, VALID)
# The global views in order: the i-th global crop an example holds is GLOBAL_VIEWS[i]
# (`ViewLayout.global_views` of them).
GLOBAL_VIEWS = (IMAGE, IMAGE2)


class Field(NamedTuple):
  """One field's shape (batch dimension first) and dtype."""

  shape: tuple[int, ...]
  dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """What one training batch of a config holds, resolved once from `config.input`, `config.max_len` and
  the image tower's patch size: the fields and their per-example sizes (`shapes`)."""

  views: ViewLayout  # `config.input.views`, decoded
  global_size: int  # S: side of IMAGE (and IMAGE2)
  local_size: int  # s: side of each local crop
  num_local: int  # M: local crops per example (0: no LOCAL_CROPS)
  mask_grid: int  # g: side of MASK's patch grid (0: no MASK, `config.input.mask_ratio` = 0)
  text_len: int  # L: tokens of TEXT and TEXT2

  @classmethod
  def from_config(cls, config) -> BatchLayout:
    inp = config.input
    views = view_layout(inp.views)
    masked = float(inp.mask_ratio) > 0
    return cls(
      views=views,
      global_size=int(inp.global_size),
      local_size=int(inp.local_size),
      num_local=int(inp.num_local) if views.local_crops else 0,
      mask_grid=masking.grid_size(inp.global_size, config.model.image.patch_size) if masked else 0,
      text_len=int(config.max_len),
    )

  @property
  def fields(self) -> tuple[str, ...]:
    """The fields a training step takes, in `shapes`' order."""
    return tuple(self.shapes(1))

  def shapes(self, batch_size: int) -> dict[str, Field]:
    """Field -> (shape, dtype) of a batch of `batch_size` examples, every field the step takes.

    The order (IMAGE, TEXT, TEXT2, then the fields the layout adds) is the order tipsito/data/synthetic.py
    draws its random fields in, so its batches stay those it drew before this declaration existed."""
    b, g, s, L = int(batch_size), self.global_size, self.local_size, self.text_len
    uint8, int32 = np.dtype(np.uint8), np.dtype(np.int32)
    out = {IMAGE: Field((b, g, g, 3), uint8), TEXT: Field((b, L), int32), TEXT2: Field((b, L), int32)}
    for name in GLOBAL_VIEWS[1 : self.views.global_views]:
      out[name] = Field((b, g, g, 3), uint8)
    if self.num_local:
      out[LOCAL_CROPS] = Field((b, self.num_local, s, s, 3), uint8)
    if self.mask_grid:
      out[MASK] = Field((b, self.mask_grid, self.mask_grid), np.dtype(bool))
    return out


def shape_spec(config, batch_size: Optional[int] = None, sharding=None) -> dict:
  """Field -> `jax.ShapeDtypeStruct` of the batch a training step of `config` takes (`batch_size`
  examples, default `config.input.batch_size`, the global batch), each with `sharding` when given: what
  the planner (tipsito/planning/pod.py) compiles the step against without building a batch."""
  import jax  # pylint: disable=import-outside-toplevel  # the module stays importable without JAX

  b = int(batch_size or config.input.batch_size)
  return {
    name: jax.ShapeDtypeStruct(f.shape, f.dtype, sharding=sharding)
    for name, f in BatchLayout.from_config(config).shapes(b).items()
  }
