"""What every `python -m tipsito.X` command shares: its entry point and its one-line errors.

Why one module: each command (tipsito/train/cli.py, tipsito/evaluate.py, tipsito/export.py,
tipsito/info.py, tipsito/plan.py, tipsito/sweep.py) is absl flags around one library call. The tail
around that call (define the flags only when run as a program, refuse stray arguments, start the JAX
processes of a multi-host job, turn a library's "bad input" exception into `error: ...` and an exit
status) was written out in each; here it is written once, so a command reads as its flags and its call.

A command module ends with

    run = command.entry_point(_define_flags, main)  # the console script (setup.py) and `python -m`

    if __name__ == "__main__":
      run()
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, Optional, Sequence

from absl import app
from absl import flags

from tipsito import distributed


def entry_point(
  define_flags: Callable[[], None],
  main: Callable[[Sequence[str]], None],
  *,
  flags_parser: Optional[Callable] = None,
) -> Callable[[], None]:
  """The `run()` of a command: its flags defined (at run time, so that importing the module defines
  nothing and two commands' modules import side by side), then absl's `app.run(main)`."""

  def run() -> None:
    define_flags()
    if flags_parser is None:
      app.run(main)
    else:
      app.run(main, flags_parser=flags_parser)

  run.__doc__ = f"Console-script entry point of {main.__module__} (tipsito/command.py)."
  return run


def no_arguments(argv: Sequence[str]) -> None:
  """Refuses words left after the flags (a flag written without `--`, a stray path) as a usage error."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {list(argv[1:])}")


def initialize_distributed() -> None:
  """Starts the JAX processes of a multi-host job from the `--distributed` flags (tipsito/distributed);
  a wrong combination of those flags is a usage error."""
  try:
    distributed.initialize_from_flags()
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def key_flags_in_help(names: Sequence[str]) -> None:
  """`--help` lists the flags of the program's own file (sys.argv[0]: a package's __main__.py, or the
  console script), not those of the module that defines them: register `names` there."""
  for name in names:
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


@contextlib.contextmanager
def exit_on(errors: tuple[type[BaseException], ...], code: int = 1) -> Iterator[None]:
  """Inside: an exception of `errors` (the library's "bad input": its message names the file, key or flag
  and what to do) ends the command with `error: <message>` on stderr and exit status `code`, no traceback."""
  try:
    yield
  except errors as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(code)
