"""Standalone evaluation config: the built-in eval suite of the `scenes` testbed (all four evals).

Why: `python -m tipsito.evaluate --config configs/eval_scenes.py --checkpoint EXPORT` scores a model on the
multi-object testbed (tipsito/data/builders/scenes.py) with the suite `tipsito.evals.suites.builtin_evals`
defines, the same one training configs use (zero-shot on the largest object, retrieval of the detailed
captions, zero-shot segmentation of the class map with a prompted background, kNN). The scenes tokenizer
(tipsito/data/assets/scenes_sp.model) is the default, since the scenes prompts and captions are its words;
an export that ships its own tokenizer uses that one.

Arg (big_vision style, comma-separated k=v): data_dir ('' = TFDS default; the dataset is built there
when missing), image_size (64, the size scenes is built at), batch_size (32), max_examples (0 = all),
num_pictures (4), cls_index (0), tokenizer ('' = the scenes tokenizer), probes (0; 1 adds the linear
probes of tipsito/evals/probes.py: segmentation, depth and classification, trained on the train split).
  python -m tipsito.evaluate --config configs/eval_scenes.py:data_dir=workdirs/demo/data --checkpoint D
"""

import ml_collections as mlc

from tipsito.config import args
from tipsito.config import defaults
from tipsito.data import tokenizer as tokenizer_lib
from tipsito.evals import suites

SCENES_TOKENIZER = tokenizer_lib.ASSETS_DIR + "/scenes_sp.model"

_DEFAULTS = dict(
  data_dir="",
  image_size=64,
  batch_size=32,
  max_examples=0,
  num_pictures=4,
  cls_index=0,
  tokenizer="",
  probes=0,
)


def get_config(arg=None):
  """Eval-only config (see module docstring)."""

  a = args.parse_arg(arg, **_DEFAULTS)
  c = mlc.ConfigDict()
  types = list(suites.BUILTIN_SUITES["scenes"]) if a["probes"] else None  # None: the suite without probes
  evals = suites.builtin_evals(
    "scenes",
    types=types,
    data_dir=a["data_dir"] or None,
    image_size=a["image_size"],
    batch_size=a["batch_size"],
    max_examples=a["max_examples"] or None,
    num_pictures=a["num_pictures"],
    cls_index=a["cls_index"],
  )
  c.evals = mlc.ConfigDict(evals)
  c.tokenizer = a["tokenizer"] or SCENES_TOKENIZER
  return defaults.typed_optionals(c)
