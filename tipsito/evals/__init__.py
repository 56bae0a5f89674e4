"""tipsito evaluations: zero-shot classification, retrieval, zero-shot segmentation, kNN, linear probes
(segmentation, depth, classification), pictures.

Why a package: the same evaluators run inside training (periodic hook, in-memory `Encoder`) and
standalone (`python -m tipsito.evaluate`), so that a number means the same thing in both places.

This file imports nothing: `tipsito.evals.templates` (inference), `tipsito.evals.suites` (configs) and
the others are used without the evaluators and the eval data code (tests/test_light_imports.py).
Entry points, by submodule:
  registry.make_evaluator(name, cfg) -> Evaluator        one evaluator from `config.evals.<name>`
  registry.make_evaluators(config) -> {name: Evaluator}  all enabled evaluators of a config
  evaluator.Evaluator.run(encoder) -> {'<name>/<metric>': float}; .pictures (uint8 arrays);
    .should_run(step, is_last=False)
  runner.run_all(evaluators, encoder, ...) -> (metrics, pictures)   compute only (tipsito.evaluate)
  runner.run_evaluators(evaluators, encoder, step=, writer=, picture_dir=, only_due=, is_last=)  + write
  suites.builtin_evals(dataset, ...) -> config.evals entries of a built-in dataset's standard suite
Other submodules: zeroshot, retrieval, segmentation, knn, probes (one protocol each), metrics, templates,
pictures. Eval data come from `tipsito.data.eval_input`.
"""
