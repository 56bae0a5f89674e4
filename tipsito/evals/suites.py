"""The standard eval suite of each built-in dataset, as `config.evals` entries (`builtin_evals`).

Why its own module: training configs (periodic evals, configs/ablations.py) and eval configs
(configs/eval_shapes.py) build their `config.evals` from it, and a config must build without importing
JAX or the evaluators (tests/test_light_imports.py); the evaluators themselves are made from these
entries by tipsito/evals/registry.py.
"""

from __future__ import annotations

from typing import Any, Sequence

from tipsito.choices import PROBE_TYPES, SCENES_PROMPTS, dataset_base_name

# Types a suite lists but `builtin_evals` adds only when `types` names them: the probes train a linear
# layer (seconds to minutes), so the demo configs' suites stay as they were unless a config asks.
OPT_IN_TYPES = PROBE_TYPES

# Which evals each built-in dataset supports, and the split each reads (tuxpaint has only 'train').
BUILTIN_SUITES: dict[str, dict[str, dict[str, Any]]] = {
  "shapes": {
    "zeroshot": dict(split="test"),
    "retrieval": dict(split="test"),
    "segmentation": dict(split="test"),
    "knn": dict(split="test", train_split="train"),
    "linear_segmentation": dict(split="test", train_split="train"),
    "linear_classification": dict(split="test", train_split="train"),
  },
  # The multi-object testbed (tipsito/data/builders/scenes.py): zero-shot classifies the largest object;
  # retrieval matches the detailed captions (one per image: the alt-texts repeat across images);
  # segmentation prompts the background as the shapes suite does; prompts are the scenes ones, whose words
  # the scenes tokenizer knows.
  "scenes": {
    "zeroshot": dict(split="test", templates=SCENES_PROMPTS, present_class=True),
    "retrieval": dict(split="test", caption_keys=("caption_detailed",)),
    "segmentation": dict(split="test", templates=SCENES_PROMPTS),
    "knn": dict(split="test", train_split="train"),
    "linear_segmentation": dict(split="test", train_split="train"),
    "linear_depth": dict(split="test", train_split="train"),
    "linear_classification": dict(split="test", train_split="train"),
  },
  "tuxpaint": {
    "zeroshot": dict(split="train"),
    "retrieval": dict(split="train"),
    "segmentation": dict(split="train"),
  },
  "fashion_mnist": {
    "zeroshot": dict(split="test"),
    "knn": dict(split="test", train_split="train", max_train_examples=10000),
  },
  # Every eval reads the fixed 'test' split (drawings a run on 'train' never saw); kNN's bank is 'train'.
  # Segmentation scores the object pixels only, among the 22 categories (label 0 = transparent
  # background is ignored, no prompted background class), as the ade150 benchmark does: the captions
  # never describe the white backdrop, so a prompted "background" measures the prompt, not whether the
  # patches on a drawing are aligned with its category's text.
  "openclipart": {
    "zeroshot": dict(split="test"),
    "retrieval": dict(split="test"),
    "segmentation": dict(split="test", background_index=None, reduce_zero_label=True),
    "knn": dict(split="test", train_split="train"),
  },
}


def builtin_evals(
  dataset: str = "shapes",
  *,
  types: Sequence[str] | None = None,
  data_dir: str | None = None,
  image_size: int = 224,
  batch_size: int = 32,
  every_steps: int = 0,
  max_examples: int | None = None,
  num_pictures: int = 4,
  cls_index: int = 0,
  **overrides,
) -> dict[str, dict]:
  """The standard eval suite of a built-in dataset as `config.evals` entries named '<dataset>_<type>'.

  Why here: training configs (periodic evals) and eval configs (standalone) share one definition, so
  the same name means the same protocol everywhere. `dataset` may name a config ('shapes/tiny');
  `overrides` apply to every entry (e.g. tokenizer=...). The probes (OPT_IN_TYPES) are included only
  when `types` names them.
  """
  base = dataset_base_name(dataset)
  if base not in BUILTIN_SUITES:
    raise KeyError(f"no built-in eval suite for {dataset!r}; known: {sorted(BUILTIN_SUITES)}")
  suite = BUILTIN_SUITES[base]
  out = {}
  for typ, spec in suite.items():
    if (types is None and typ in OPT_IN_TYPES) or (types is not None and typ not in types):
      continue
    cfg = dict(
      type=typ,
      dataset=dataset,
      data_dir=data_dir,
      image_size=image_size,
      batch_size=batch_size,
      every_steps=every_steps,
      max_examples=max_examples,
      num_pictures=num_pictures if typ in ("segmentation", "linear_segmentation") else 0,
      cls_index=cls_index,
    )
    cfg.update(spec)
    if (typ == "knn" or typ in OPT_IN_TYPES) and max_examples is not None:
      cap = 4 * int(max_examples)
      cfg["max_train_examples"] = (
        min(int(spec["max_train_examples"]), cap) if "max_train_examples" in spec else cap
      )
    cfg.update(overrides)
    out[f"{base}_{typ}"] = cfg
  return out
