"""tipsito evaluations: zero-shot classification, retrieval, zero-shot segmentation, kNN, linear probes
(segmentation, depth, classification), pictures.

Why a package: the same evaluators run inside training (periodic hook, in-memory `Encoder`) and
standalone (`python -m tipsito.evaluate`), so that a number means the same thing in both places.

Public API:
  make_evaluator(name, cfg) -> Evaluator        one evaluator from `config.evals.<name>`
  make_evaluators(config) -> {name: Evaluator}  all enabled evaluators of a config
  Evaluator.run(encoder) -> {'<name>/<metric>': float}; Evaluator.pictures (uint8 arrays)
  Evaluator.should_run(step, is_last=False)
  run_all(evaluators, encoder, ...) -> (metrics, pictures)   compute only (tipsito.evaluate)
  run_evaluators(evaluators, encoder, step=, writer=, picture_dir=, only_due=, is_last=)  + write
  builtin_evals(dataset, ...) -> config.evals entries of a built-in dataset's standard suite
Submodules: registry (config -> evaluator, built-in suites), evaluator (the base class), runner
(summaries and pictures), zeroshot, retrieval, segmentation, knn, probes (one protocol each), metrics,
templates, pictures. Eval data come from `tipsito.data.eval_input`.
"""

from tipsito.evals.evaluator import Evaluator
from tipsito.evals.registry import EVALUATOR_TYPES
from tipsito.evals.registry import builtin_evals
from tipsito.evals.registry import make_evaluator
from tipsito.evals.registry import make_evaluators
from tipsito.evals.runner import run_all
from tipsito.evals.runner import run_evaluators

__all__ = [
  "EVALUATOR_TYPES",
  "Evaluator",
  "builtin_evals",
  "make_evaluator",
  "make_evaluators",
  "run_all",
  "run_evaluators",
]
