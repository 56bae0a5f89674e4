"""`python -m tipsito.sweep --config configs/ablations.py:study=NAME --seeds 3 --workdir W [--parallel N]`:
every arm of a study for every seed, with the evals at the end; resumable.

Writes `W/<arm>/seed_<s>/` (each run's training workdir, `job.json`, `log.txt` and, once finished,
`result.json`), `W/results.json` (every number per arm and seed), `W/results.md` (mean ± std per metric and
arm, best in bold) and `W/plots/*.png`. Rerun the same command after an interruption: finished runs are
never rerun, a half-finished run resumes from its latest checkpoint.

Flags: --config (a study config: configs/ablations.py; `--config.key=value` overrides work as usual),
--seeds (number of seeds: F..F+N-1 with --first_seed F, 0 by default), --workdir, --parallel (runs at the same time; 1 = in this process),
--only (comma-separated arms; the arms they depend on are added), --dry_run (list the runs and their
overrides and status, run nothing), --noplots, --render_only (recompute the statistics of W/results.json
from its stored per-seed values and rewrite it and W/results.md; runs nothing, e.g. for a study that ran
before the statistics existed). The library is tipsito/studies/.

Exit status: 0 when every run is finished, 1 when a run failed (the others still ran), 75 when stopped by
SIGTERM / Ctrl-C after the running jobs saved a checkpoint (rerun to resume), 2 for a wrong study config
(before anything ran).
"""

from __future__ import annotations

import shlex
import sys
from typing import Sequence

from absl import flags

from tipsito import command

FLAGS = flags.FLAGS


def _define_flags() -> None:
  """Defines the CLI flags (idempotent; only when run as a program)."""
  if "seeds" in FLAGS:
    return
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  config_flags.DEFINE_config_file(
    "config", None, "Study config (configs/ablations.py:study=NAME,...).", lock_config=True
  )
  flags.DEFINE_integer(
    "seeds", 3, "Number of seeds per arm (seeds F..F+N-1, F = --first_seed).", lower_bound=1
  )
  flags.DEFINE_integer(
    "first_seed",
    0,
    "The first seed. A pilot runs on seeds that are never reported (e.g. --first_seed 100 --seeds 1 in a "
    "workdir of its own) before the reported seeds 0..N-1.",
    lower_bound=0,
  )
  flags.DEFINE_string("workdir", None, "Sweep folder (rerun the same command on it to resume).")
  flags.DEFINE_integer(
    "parallel",
    1,
    "Runs at the same time (1: one after the other in this process; N > 1: N subprocesses).",
    lower_bound=1,
  )
  flags.DEFINE_list("only", None, "Run only these arms (and the arms they depend on).")
  flags.DEFINE_bool("dry_run", False, "List the runs, their overrides and status; run nothing.")
  flags.DEFINE_bool("plots", True, "Write the PNG plots (needs matplotlib: the `studies` extra).")
  flags.DEFINE_bool(
    "render_only",
    False,
    "Recompute the statistics (paired differences, BH-adjusted p, the primary's verdict) of W/results.json "
    "from its stored per-seed values with the config's metrics and primary; rewrite it and W/results.md; "
    "run nothing.",
  )
  flags.mark_flags_as_required(["config", "workdir"])
  command.key_flags_in_help(
    ["config", "workdir", "seeds", "first_seed", "parallel", "only", "dry_run", "plots", "render_only"]
  )


def main(argv: Sequence[str]) -> None:
  """Parses flags, runs the sweep, exits with its status."""
  command.no_arguments(argv)
  # After flag parsing, so that --help stays light.
  from tipsito.studies import arms  # heavy: JAX and the trainer's modules
  from tipsito.studies import runner  # heavy: as above

  command_line = " ".join(["python -m tipsito.sweep"] + [shlex.quote(a) for a in sys.argv[1:]])
  with command.exit_on((arms.StudyError, ImportError), code=2):
    if FLAGS.render_only:
      if FLAGS.dry_run or FLAGS.only:
        raise arms.StudyError("--render_only runs nothing: drop --dry_run / --only")
      sys.exit(
        runner.render_only(
          FLAGS.config,
          workdir=FLAGS.workdir,
          plots=FLAGS.plots,
          command=command_line,
          out=lambda line: print(line, flush=True),
        )
      )
    code = runner.run_sweep(
      FLAGS.config,
      seeds=list(range(FLAGS.first_seed, FLAGS.first_seed + FLAGS.seeds)),
      workdir=FLAGS.workdir,
      parallel=FLAGS.parallel,
      only=FLAGS.only,
      dry_run=FLAGS.dry_run,
      plots=FLAGS.plots,
      command=command_line,
      out=lambda line: print(line, flush=True),
    )
  sys.exit(code)


run = command.entry_point(_define_flags, main)  # tipsito-sweep


if __name__ == "__main__":
  run()
