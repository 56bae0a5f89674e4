"""Experiment configuration: the complete default config, paper config families and their validation.

Why a package: the experiment files under configs/ (and any user's own config file) import these modules
like any other (`from tipsito.config import defaults`), and an installed tipsito validates a config without
a checkout of configs/. It is a leaf: outside itself it imports only tipsito/choices.py and tipsito/paths.py (the contract in
tests/test_import_structure.py), so every config builds and validates without JAX, Flax, grain, Orbax,
TensorFlow or PIL (tests/test_light_imports.py); the checks that read disk (data, tokenizer, eval splits
and fields) run before training in tipsito/data/prepare.py and tipsito/evals/config_checks.py.

  args       big_vision-style `configs/X.py:k=v,...` argument parsing.
  defaults   `base_config(recipe, variant)`: every key that exists, with its default; data presets.
  paper      config families shared by a paper config and its stage-2 (high-resolution) follow-up.
  presets    the towers' size presets ('B/16', 'g/14', ...), pixel statistics and tower structures.
  recipes    `config.recipe` -> `Recipe`: model parts, loss terms and their default weights.
  schema     every key, declared once: type, default, allowed values, resume safety, description.
  validation rejects unknown keys and wrong values (the eval settings included) before anything compiles.
"""
