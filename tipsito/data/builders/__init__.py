"""tipsito TFDS dataset builders (array_record): shapes, scenes, tuxpaint, fashion_mnist, openclipart, table,
webdataset.

Why lazy: importing a builder imports TFDS; multiprocessing workers and light tools import this
package without paying for that. `builder_class(name)` imports the one module it needs.
"""

from __future__ import annotations

import importlib

# name -> (module, class). The TFDS name of fashion_mnist clashes with TFDS's own catalogue entry,
# so that builder is not registered; read it as 'fashion_mnist/default' or via tipsito.data.sources.
BUILDERS = {
  "shapes": ("tipsito.data.builders.shapes", "Shapes"),
  "scenes": ("tipsito.data.builders.scenes", "Scenes"),
  "tuxpaint": ("tipsito.data.builders.tuxpaint", "Tuxpaint"),
  "fashion_mnist": ("tipsito.data.builders.fashion_mnist", "FashionMnist"),
  "openclipart": ("tipsito.data.builders.openclipart", "Openclipart"),
  "table": ("tipsito.data.builders.table", "Table"),
  "webdataset": ("tipsito.data.builders.webdataset", "Webdataset"),
}


def builder_class(name: str):
  """The builder class of `name` (one of BUILDERS); imports its module on first use."""
  if name not in BUILDERS:
    raise ValueError(f"unknown tipsito dataset builder {name!r}; known: {sorted(BUILDERS)}")
  module, cls = BUILDERS[name]
  return getattr(importlib.import_module(module), cls)


def register_all() -> None:
  """Imports every builder module so that `tfds.builder(NAME)` finds the registered ones."""
  for name in BUILDERS:
    builder_class(name)
