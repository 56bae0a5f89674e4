"""Experiment configuration: the complete default config, paper config families and their validation.

Why a package: the experiment files under configs/ (and any user's own config file) import these modules
like any other (`from tipsito.config import defaults`), and an installed tipsito validates a config without
a checkout of configs/.

  args       big_vision-style `configs/X.py:k=v,...` argument parsing.
  defaults   `base_config(recipe, variant)`: every key that exists, with its default; data presets.
  paper      config families shared by a paper config and its stage-2 (high-resolution) follow-up.
  validation rejects unknown keys and wrong values before anything compiles.
"""
