"""Config -> evaluator: the evaluator types, the built-in eval suites, and `make_evaluator(s)`.

Why only this here: `config.evals.<name>.type` names an evaluator class, and training configs (periodic
evals) and eval configs (standalone) share one definition of each built-in suite, so the same name means
the same protocol everywhere. Data reading lives in `tipsito.data.eval_input`, the shared evaluator code
in `evaluator.py`, the metrics in the evaluator modules and `metrics.py`, and running them with
summaries and pictures in `runner.py`.
"""

from __future__ import annotations

from tipsito.evals import knn
from tipsito.evals import probes
from tipsito.evals import retrieval
from tipsito.evals import segmentation
from tipsito.evals import zeroshot
from tipsito.config import validation as config_validation
from tipsito.evals.evaluator import Evaluator
from tipsito.evals.evaluator import as_dict
from tipsito.evals.suites import BUILTIN_SUITES, OPT_IN_TYPES, builtin_evals  # noqa: F401 (re-exported)

EVALUATOR_TYPES: dict[str, type[Evaluator]] = {
  "zeroshot": zeroshot.ZeroShotEvaluator,
  "retrieval": retrieval.RetrievalEvaluator,
  "segmentation": segmentation.SegmentationEvaluator,
  "knn": knn.KnnEvaluator,
  "linear_segmentation": probes.LinearSegmentationEvaluator,
  "linear_depth": probes.LinearDepthEvaluator,
  "linear_classification": probes.LinearClassificationEvaluator,
}


def make_evaluator(name: str, cfg, **kwargs) -> Evaluator:
  """Builds the evaluator of `cfg.type` (a key of EVALUATOR_TYPES)."""
  return EVALUATOR_TYPES[_type_of(name, cfg)](name, cfg, **kwargs)


def _type_of(name: str, cfg) -> str:
  given = as_dict(cfg)
  typ = given["type"] if "type" in given else None
  if typ not in EVALUATOR_TYPES:
    raise KeyError(f"eval {name!r}: unknown type {typ!r}; known: {sorted(EVALUATOR_TYPES)}")
  return typ


def resolved_config(name: str, cfg) -> dict:
  """`config.evals.<name>` completed: the values the evaluator reads (tipsito/config/validation.py
  `eval_settings`: the schema's defaults of its type, a segmentation benchmark's sizes and class names
  too), for callers that need them without building the evaluator (`python -m tipsito.plan`)."""
  if _type_of(name, cfg) == "segmentation":
    return segmentation.resolve_config(cfg, name=name)
  return config_validation.eval_settings(name, cfg, need_dataset=False)


def make_evaluators(config) -> dict[str, Evaluator]:
  """All enabled evaluators of `config.evals` (a top-level config or the evals dict itself)."""
  evals = as_dict(config["evals"] if "evals" in config else config)
  out = {}
  for name in sorted(evals):
    cfg = as_dict(evals[name])
    if not config_validation.eval_enabled(cfg):  # a disabled eval is not built (nor checked)
      continue
    out[name] = make_evaluator(name, cfg)
  return out
