"""Ablation studies: arms of config overrides, run for several seeds, with their results and plots.

`python -m tipsito.sweep` (tipsito/sweep.py) is the command line; the studies are configs/ablations.py.
Modules: `arms.py` (study config -> arms -> one checked training config per arm and seed), `job.py` (one
run: train, evaluate, write its result file), `results.py` (a run's numbers; results.json and
results.md), `paired.py` (paired differences, t-tests, Benjamini-Hochberg, seeds needed), `provenance.py`
(commit, machine, packages, data fingerprints), `plots.py` (PNG plots), `runner.py` (the sweep: what is
finished, what runs, progress, resume, render-only).
"""
