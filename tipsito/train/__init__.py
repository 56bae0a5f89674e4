"""Training system: explicit TrainState, optimisers, mesh/sharding rules, the jitted step, the loop and
Orbax checkpointing.

`python -m tipsito.train` (this package's __main__) and the `tipsito-train` console script both call
`run()`; the package is imported lazily so `import tipsito.train.state` stays light.
The entry point itself lives in `tipsito/train/cli.py` and is re-exported here.
"""


def run() -> None:
  """Console-script entry point (tipsito-train): see tipsito.train.cli."""
  from tipsito.train import cli  # lazy: `import tipsito.train.state` stays light

  cli.run()


def train_and_evaluate(config, workdir, **kwargs):
  """See tipsito.train.loop.train_and_evaluate."""
  from tipsito.train import loop  # lazy: as above

  return loop.train_and_evaluate(config, workdir, **kwargs)
