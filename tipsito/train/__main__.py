"""`python -m tipsito.train`: runs the training entry point (tipsito.train.cli)."""

from tipsito.train import cli

if __name__ == "__main__":
  cli.run()
