"""Every command README.md, the docs pages (docs/*.md) and launch/ print must parse as printed (flags, config
files, config overrides).

Why: a command that fails in flag parsing (e.g. `--config.data.data_dir=/x` on a key whose default is
None) is the first thing a new user runs into. Nothing trains here: each CLI's own flag definitions parse
each command line (one subprocess per absl tool, since absl flags are process-global), `tipsito.train`
commands are also validated with `tipsito.config.validation`, and the launch scripts run with fake
`gcloud` / `python` executables that record the command they would run on the pod.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def documented_files() -> list[pathlib.Path]:
  """README.md and every page of the docs site (docs/*.md). Not docs/results.md, a record of the studies as
  they were run (its data line names the conversion without `--data_dir`, as the sweep ran it), nor the
  study folders under docs/results/, whose results.md files the sweep writes and the site leaves out."""
  return [README] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "results.md")


# Module of each CLI (absl tools are parsed in a subprocess each; argparse ones in-process).
ABSL_TOOLS = {
  "train": "tipsito.train.cli",
  "evaluate": "tipsito.evaluate",
  "export": "tipsito.export",
  "info": "tipsito.info",
  "bench.step_bench": "tipsito.bench.step_bench",
  "plan": "tipsito.plan",
  "sweep": "tipsito.sweep",
  "bench.vs_big_vision": "tipsito.bench.vs_big_vision",
}
ARGPARSE_TOOLS = (
  "data.convert",
  "data.pipeline_bench",
  "data.convert_bench",
  "data.train_tokenizer",
  "dense.train",
  "dense.pictures",
)


def _normalise(cmd: str) -> str:
  """Syntax placeholders of the prose -> a concrete command: `F[:args]` -> configs/demo.py, optional
  `[--flag v]` -> `--flag v`, numeric N/B/P -> 8, trailing `...` dropped. Path placeholders (W, E, D)
  stay: they are valid paths to a parser."""
  cmd = " ".join(cmd.split())
  cmd = re.sub(r"\bF(\.py)?\[:args\]", "configs/demo.py", cmd)
  while re.search(r"\[(--[^\[\]]*)\]", cmd):  # innermost first: `[--sharding [--devices N]]`
    cmd = re.sub(r"\[(--[^\[\]]*)\]", r"\1", cmd)
  cmd = cmd.replace("=$I", "=0")  # the loop variable of the README's per-process `for I in 0 1` line
  cmd = re.sub(r"\s*&$", "", cmd)  # backgrounded process
  cmd = re.sub(r"\s*\.\.\.$", "", cmd)
  cmd = re.sub(r"(--\w+) [NBP](?= |$)", r"\1 8", cmd)  # numeric placeholders (`--batch B`, `--vocab_size N`)
  return cmd.strip()


def readme_commands(files: list[pathlib.Path] | None = None) -> tuple[list[str], dict[str, str]]:
  """(commands, env): every `python -m tipsito...` / `bash launch/...` command of README.md and the docs
  pages (fenced bash blocks and inline code), and the environment their `export` lines set."""
  cmds, env = [], {}
  for path in documented_files() if files is None else files:
    file_cmds, file_env = _commands_of(path.read_text())
    cmds += file_cmds
    env.update(file_env)
  return cmds, env


def _commands_of(text: str) -> tuple[list[str], dict[str, str]]:
  """(commands, env) of one markdown text, normalised (see `_normalise`)."""
  cmds, env = [], {}
  fenced = re.findall(r"```bash\n(.*?)```", text, re.S)
  for block in fenced:
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
      line = re.split(r"\s+#\s", line)[0].strip()
      if line.startswith("export "):
        env.update(kv.split("=", 1) for kv in shlex.split(line)[1:] if "=" in kv)
      for part in line.split("&&"):
        part = part.strip()
        if part.startswith(("python -m tipsito", "bash launch/")):
          cmds.append(part)
  prose = re.sub(r"```.*?```", "", text, flags=re.S)
  for span in re.findall(r"`([^`]+)`", prose):
    span = " ".join(span.split())
    if span.startswith(("python -m tipsito", "bash launch/", "FAKE_DEVICES=")):
      cmds.append(span)
    elif span.startswith("--config.") and "=" in span and "k=v" not in span and "key=value" not in span:
      key = span.split("=", 1)[0][len("--config.") :]
      if key.startswith("evals."):
        cmds.append(f"python -m tipsito.evaluate --config configs/eval_shapes.py --checkpoint E {span}")
      elif key.startswith("distill."):
        cmds.append(f"python -m tipsito.train --config configs/tipsv2_distill.py --workdir W {span}")
      else:
        cmds.append(f"python -m tipsito.train --config configs/demo.py --workdir W {span}")
    elif re.match(r"^(configs/)?\w+\.py:\w+=\S*$", span) and "k=v" not in span:
      cfg = span if span.startswith("configs/") else "configs/" + span
      cmds.append(f"python -m tipsito.train --config {cfg} --workdir W")
  out = []
  for c in cmds:
    c = _normalise(c)
    m = re.match(r"(bash launch/\S+) (\w+(?: \| \w+)+)$", c)
    if m:  # `logs | stop | delete`: three commands
      out += [f"{m.group(1)} {sub}" for sub in m.group(2).split(" | ")]
    else:
      out.append(c)
  return out, env


def _fake_bin(tmp_path: pathlib.Path) -> pathlib.Path:
  """`gcloud` and `python` that append their argv (one JSON list per line) to $FAKE_LOG and succeed."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name in ("gcloud", "python"):
    p = bin_dir / name
    p.write_text(
      textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys
        with open(os.environ["FAKE_LOG"], "a") as f:
          f.write(json.dumps([{name!r}] + sys.argv[1:]) + "\\n")
        """)
    )
    p.chmod(0o755)
  return bin_dir


def _run_launch(cmd: str, env: dict, tmp_path: pathlib.Path) -> list[list[str]]:
  """Runs a `bash launch/...` command with fake gcloud/python; returns the recorded invocations."""
  log = tmp_path / "fake.log"
  log.unlink(missing_ok=True)
  bin_dir = tmp_path / "bin" if (tmp_path / "bin").exists() else _fake_bin(tmp_path)
  full_env = {
    **os.environ,
    **env,
    "FAKE_LOG": str(log),
    "PATH": f"{bin_dir}:{os.environ['PATH']}",
    "PROJECT": "p",
    "REPO_URL": "https://example.invalid/tipsito.git",
  }
  words = shlex.split(cmd)
  assigns = {}
  while "=" in words[0] and not words[0].startswith("-"):
    k, v = words.pop(0).split("=", 1)
    assigns[k] = v
  r = subprocess.run(words, cwd=ROOT, env={**full_env, **assigns}, capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, f"{cmd!r} exited {r.returncode}: {r.stderr[-2000:]}"
  return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _train_argv_from_launch(calls: list[list[str]]) -> list[list[str]]:
  """The `python -m tipsito.train ...` argv each recorded call would run (pod ssh command or local exec)."""
  out = []
  for call in calls:
    if call[0] == "python" and call[1:3] == ["-m", "tipsito.train"]:
      out.append(call[3:])
    for arg in call:
      m = re.search(r"python -m tipsito\.train (.*?)(?: >|$)", arg)
      if m and arg.startswith("--command="):
        out.append(shlex.split(m.group(1)))
  return out


_WORKER = textwrap.dedent("""\
    import importlib, json, sys
    from absl import flags
    tool, module = sys.argv[1], sys.argv[2]
    mod = importlib.import_module(module)
    mod._define_flags()
    FLAGS = flags.FLAGS
    errors = []
    for argv in json.loads(sys.stdin.read()):
      FLAGS.unparse_flags()
      for name in [n for n in FLAGS if n.startswith("config.")]:  # overrides of the previous command
        delattr(FLAGS, name)
      sys.argv = [tool] + argv  # config_flags reads the overrides from sys.argv
      try:
        FLAGS(sys.argv)
        if tool == "train":
          from tipsito.config import validation as config_validation
          # Files the commands name (tokenizer, data) are placeholders here; that a paper config refuses a
          # tokenizer of the wrong size is tests/test_configs.py's job.
          config_validation.validate(FLAGS.config)
      except BaseException as e:  # SystemExit from absl counts as a failure too
        errors.append([argv, f"{type(e).__name__}: {e}"])
    print("RESULT " + json.dumps(errors))
    """)


def _parse_absl(tool: str, argvs: list[list[str]]) -> list:
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
  r = subprocess.run(
    [sys.executable, "-c", _WORKER, tool, ABSL_TOOLS[tool]],
    input=json.dumps(argvs),
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  line = [s for s in r.stdout.splitlines() if s.startswith("RESULT ")]
  assert line, f"parser subprocess for {tool} failed: {r.stderr[-3000:]}"
  return json.loads(line[-1][len("RESULT ") :])


def _parse_argparse(tool: str, argv: list[str], monkeypatch) -> None:
  if tool == "data.convert":
    from tipsito.data import convert

    convert._parser().parse_args(argv)
  elif tool in ("data.pipeline_bench", "data.convert_bench"):  # `pipeline_bench --convert` = convert_bench
    from tipsito.data import convert_bench, pipeline_bench

    monkeypatch.setattr(pipeline_bench, "run_data_bench", lambda *a, **k: {"parsed": 1.0})
    monkeypatch.setattr(convert_bench, "run_convert_bench", lambda *a, **k: {"parsed": 1.0})
    (pipeline_bench if tool == "data.pipeline_bench" else convert_bench).main(argv)
  elif tool == "data.train_tokenizer":
    from tipsito.data import train_tokenizer

    monkeypatch.setattr(train_tokenizer, "train", lambda *a, **k: __file__)
    train_tokenizer.main(argv)
  elif tool == "dense.train":
    from tipsito.dense import train as dense_train

    dense_train.parse_args(argv)
  elif tool == "dense.pictures":
    from tipsito.dense import pictures

    pictures.parser().parse_args(argv)


def test_readme_lists_the_documented_commands():
  cmds, env = readme_commands()
  joined = "\n".join(cmds)
  # The commands the run-safety issue found broken, and one of each tool, must be among those checked.
  for needle in (
    "--config.data.data_dir=/data/tfds",
    "--config.tokenizer=",
    "--config.init_from=",
    "tipsv2_g14_hires.py:init=W1",
    "--config.distill.teacher_image_npz=",
    "bash launch/tpu_v5p.sh run configs/tipsv2_g14.py --config.data.data_dir=/mnt/tfds",
    "python -m tipsito.evaluate",
    "python -m tipsito.export",
    "python -m tipsito.info",
    "python -m tipsito.bench.step_bench",
    "python -m tipsito.data.pipeline_bench",
    "python -m tipsito.data.convert table",
    "FAKE_DEVICES=8",
  ):
    assert needle in joined, needle
  assert "WORKDIR" in env
  # The README's own commands and each docs page that prints commands are read (a page renamed or moved
  # out of docs/ would silently drop its commands from the check otherwise).
  assert any(
    c.startswith("python -m tipsito.train --config configs/demo.py") for c in readme_commands([README])[0]
  )
  for page in (
    "getting-started",
    "training",
    "configs",
    "pods",
    "data",
    "models",
    "using",
    "evaluation",
    "studies",
  ):
    assert readme_commands([ROOT / "docs" / f"{page}.md"])[0], f"docs/{page}.md: no command found"


def test_every_readme_and_launch_command_parses(tmp_path, monkeypatch):
  cmds, env = readme_commands()
  by_tool: dict[str, list[list[str]]] = {t: [] for t in ABSL_TOOLS}
  launch_calls = 0
  for cmd in cmds:
    if "launch/" in cmd:
      calls = _run_launch(cmd, env, tmp_path)
      launch_calls += len(calls)
      by_tool["train"] += _train_argv_from_launch(calls)
      continue
    words = shlex.split(cmd)
    tool, argv = words[2][len("tipsito.") :], words[3:]
    if argv == ["--help"]:
      continue  # absl's --help exits from app.run; tests/test_multihost_cli.py runs it for real
    if tool in ARGPARSE_TOOLS:
      try:
        _parse_argparse(tool, argv, monkeypatch)
      except SystemExit as e:
        pytest.fail(f"{cmd!r} does not parse (exit {e.code})")
    else:
      by_tool[tool].append(argv)
  assert launch_calls >= 7  # create, install, run, logs, stop, delete, local.sh
  train_from_launch = [a for a in by_tool["train"] if "--distributed" in a]
  # The TPU `run` line reaches the pod's train command with its overrides (local_multiprocess.sh adds more).
  assert any("--config.data.data_dir=/mnt/tfds" in a for a in train_from_launch), train_from_launch
  failures = []
  for tool, argvs in by_tool.items():
    if argvs:
      failures += [(tool, a, e) for a, e in _parse_absl(tool, argvs)]
  assert not failures, "\n".join(f"{t} {' '.join(a)}\n  -> {e}" for t, a, e in failures)


def test_every_none_default_is_overridable():
  """Each key whose value is None in a shipped config can be set from the command line."""
  from ml_collections import config_dict
  from tipsito.config import defaults
  import importlib.util

  def walk(c, prefix=""):
    for k in c.keys():
      v = c[k]
      if isinstance(v, config_dict.ConfigDict):
        yield from walk(v, f"{prefix}{k}.")
      elif v is None:
        yield f"{prefix}{k}", c._fields[k]

  untyped = []
  for path in sorted((ROOT / "configs").glob("*.py")):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for key, field in walk(mod.get_config(None)):
      if not (isinstance(field, config_dict.FieldReference) and field.get_type() is not type(None)):
        untyped.append(f"{path.name}: {key}")
  assert not untyped, f"None-valued keys that the command line cannot set: {untyped}"
  assert defaults.OPTIONAL_KEYS["data.data_dir"] is str
