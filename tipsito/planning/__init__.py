"""Planning a run before it runs: what a config costs and whether it fits a pod, without a chip.

`costs.py` (behind `python -m tipsito.info`): parameter counts per tower and part, the train state's size,
the head-only EMA saving, the crops, the effective loss weights and the sharding plan, by `jax.eval_shape`.
`pod.py` (behind `python -m tipsito.plan`): the train step and the evals compiled ahead of time for a TPU
topology that is not present, per-chip memory and FLOPs, and the search for a configuration that fits.
The commands themselves are tipsito/info.py and tipsito/plan.py. This file imports nothing.
"""
