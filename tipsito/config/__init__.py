"""Experiment configuration: the complete default config, paper config families and their validation.

Why a package: the experiment files under configs/ (and any user's own config file) import these modules
like any other (`from tipsito.config import defaults`), and an installed tipsito validates a config without
a checkout of configs/. It is a leaf: outside itself it imports only tipsito/choices.py, tipsito/paths.py,
tipsito/data/sources.py and tipsito/data/tokenizer.py (the contract in tests/test_import_structure.py),
so every config builds without JAX, Flax, grain, Orbax or TensorFlow (tests/test_light_imports.py).

  args       big_vision-style `configs/X.py:k=v,...` argument parsing.
  defaults   `base_config(recipe, variant)`: every key that exists, with its default; data presets.
  paper      config families shared by a paper config and its stage-2 (high-resolution) follow-up.
  presets    the towers' size presets ('B/16', 'g/14', ...), pixel statistics and tower structures.
  recipes    `config.recipe` -> `Recipe`: model parts, loss terms and their default weights.
  schema     every key, declared once: type, default, allowed values, resume safety, description.
  validation rejects unknown keys and wrong values before anything compiles (still imports JAX through
             the segmentation eval check: see PENDING in tests/test_import_structure.py).
"""
