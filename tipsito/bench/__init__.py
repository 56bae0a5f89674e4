"""Benchmark tools, apart from the library so that the top of `tipsito/` reads as commands and libraries.

`python -m tipsito.bench.step_bench` (console script `tipsito-bench`): tipsito's train step per recipe, its
time, FLOPs and compiled memory. `python -m tipsito.bench.vs_big_vision`: the same step next to big_vision's
two-tower CLIP step, in one process on the same shapes, or compiled ahead of time for a TPU topology. Nothing
in the library imports this package (tests/test_import_structure.py). The input pipeline's throughput tools
stay beside the pipeline they measure (tipsito/data/pipeline_bench.py, tipsito/data/convert_bench.py).
"""
