"""Standalone evaluation config: the built-in eval suites (default: `shapes`, all four evals).

Why: `python -m tipsito.evaluate --config configs/eval_shapes.py --checkpoint EXPORT` needs only
`config.evals` (and `config.tokenizer` for exports without one); the suites come from
`tipsito.evals.suites.builtin_evals`, the same definition training configs use.

Arg (big_vision style, comma-separated k=v): datasets ('shapes'; '+'-joined, e.g.
'shapes+tuxpaint+fashion_mnist'; a config name such as 'shapes/tiny' is allowed), data_dir ('' = TFDS
default), image_size (224), batch_size (32), max_examples (0 = all), num_pictures (4), cls_index (0),
tokenizer ('' = shipped demo model).
  python -m tipsito.evaluate --config configs/eval_shapes.py:image_size=56,max_examples=64 --checkpoint D
"""

import ml_collections as mlc

from tipsito.config import args
from tipsito.config import defaults

_DEFAULTS = dict(
  datasets="shapes",
  data_dir="",
  image_size=224,
  batch_size=32,
  max_examples=0,
  num_pictures=4,
  cls_index=0,
  tokenizer="",
)


def get_config(arg=None):
  """Eval-only config (see module docstring)."""
  from tipsito.evals import suites  # pylint: disable=g-import-not-at-top

  a = args.parse_arg(arg, **_DEFAULTS)
  c = mlc.ConfigDict()
  evals = {}
  for ds in a["datasets"].split("+"):
    evals.update(
      suites.builtin_evals(
        ds,
        data_dir=a["data_dir"] or None,
        image_size=a["image_size"],
        batch_size=a["batch_size"],
        max_examples=a["max_examples"] or None,
        num_pictures=a["num_pictures"],
        cls_index=a["cls_index"],
      )
    )
  c.evals = mlc.ConfigDict(evals)
  c.tokenizer = a["tokenizer"] or None
  return defaults.typed_optionals(c)
