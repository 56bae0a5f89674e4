"""What a `config.init_from` path is: one of the formats tipsito reads, told apart from the files alone.

Why in config/ and light (JSON and file names only, no weights, no JAX): validation
(tipsito/config/validation.py) must know the kind before anything compiles or is written (a workdir's
teacher can be continued, an export's cannot), configs/finetune.py must find the files whose architecture
it copies, and the loader (tipsito/train/assembly.py `init_from`) must read each kind with its own reader.
Detecting the kind in one place keeps the three in agreement, and an unknown path is refused once, with
what was found.

The kinds:
  * `workdir`: a training workdir (config.json with a recipe, or checkpoints/), its `checkpoints/` folder
    or a step folder in it: params and, with `init_teacher='continue'`, its teacher.
  * `export`: a tipsito export (config.json with a format_version, params/), e.g. what
    `python -m tipsito.export --tips_image_npz V --tips_text_npz T --output E` writes.
  * `hf_tipsv2`, `hf_clip`: a Hugging Face folder whose config.json says model_type 'tipsv2' / 'clip'.
  * `tips_npz`: official TIPS weights: a folder with `vision.npz` and `text.npz` (what
    `--format tips_npz` writes), or the vision `.npz` itself, whose text file is `<name>_text.npz` for
    `<name>_vision.npz` (the released files' naming), else the one `*text*.npz` beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from tipsito import paths

KINDS = ("workdir", "export", "hf_tipsv2", "hf_clip", "tips_npz")
# Kinds that hold towers only: no DINO/iBOT heads, mask token, fusion, EMA or centres to continue.
TOWERS_ONLY = ("export", "hf_tipsv2", "hf_clip", "tips_npz")
VISION_NPZ, TEXT_NPZ, TOKENIZER = "vision.npz", "text.npz", "tokenizer.model"

WHAT_IT_TAKES = (
  "init_from takes a training workdir (or its checkpoints/ folder or a step folder), a tipsito export "
  "(config.json + params/), a Hugging Face Tipsv2 or CLIP folder (config.json with model_type 'tipsv2' "
  "or 'clip'), or official TIPS weights (a folder with vision.npz + text.npz, or the vision .npz file "
  "next to its text .npz)"
)


class InitSourceError(ValueError):
  """A `config.init_from` path that is none of the kinds tipsito reads (the message says what was found)."""


@dataclasses.dataclass(frozen=True)
class InitSource:
  """A detected `init_from`: its kind, the path as given, and for `tips_npz` the two files."""

  kind: str
  path: str
  image_npz: Optional[str] = None
  text_npz: Optional[str] = None

  @property
  def towers_only(self) -> bool:
    return self.kind in TOWERS_ONLY

  def describe(self) -> str:
    if self.kind == "tips_npz":
      return f"official TIPS weights {self.image_npz} + {self.text_npz}"
    return {
      "workdir": "a training run",
      "export": "a tipsito export",
      "hf_tipsv2": "a Hugging Face Tipsv2 folder",
      "hf_clip": "a Hugging Face CLIP folder",
    }[self.kind] + f" {self.path}"


def _json(f) -> Optional[dict]:
  try:
    out = json.loads(f.read_text())
  except (ValueError, OSError):
    return None
  return out if isinstance(out, dict) else None


def _found(p) -> str:
  """What is at `p`, for an error: missing, a file, or a folder and (some of) its entries."""
  if not p.exists():
    return "it does not exist"
  if not p.is_dir():
    return "it is a file that is none of these"
  names = sorted(c.name + ("/" if c.is_dir() else "") for c in p.iterdir())
  shown = ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "")
  return f"it is a folder holding [{shown}]" if names else "it is an empty folder"


def _text_npz_for(vision) -> Optional[str]:
  """The text .npz that goes with official vision weights `vision` (see the module docstring)."""
  name = vision.name
  if name == VISION_NPZ and (vision.parent / TEXT_NPZ).is_file():
    return os.fspath(vision.parent / TEXT_NPZ)
  if "vision" in name:
    i = name.rfind("vision")
    twin = vision.parent / (name[:i] + "text" + name[i + len("vision") :])
    if twin.is_file():
      return os.fspath(twin)
  texts = [c for c in vision.parent.iterdir() if c.name.endswith(".npz") and "text" in c.name]
  return os.fspath(texts[0]) if len(texts) == 1 else None


def _is_step_folder(p) -> bool:
  return p.name.isdigit() and p.parent.name == "checkpoints"


def detect(path: str, key: str = "config.init_from") -> InitSource:
  """The kind of `path` (KINDS), or InitSourceError naming `key`, what was found and what is taken."""
  p = paths.as_path(path)
  given = os.fspath(path)
  if p.is_file() and p.name.endswith(".npz"):
    text = _text_npz_for(p)
    if text is None:
      raise InitSourceError(
        f"{key}={given!r}: official TIPS vision weights, but no text .npz found beside it (looked for "
        f"{p.name.replace('vision', 'text')!r}, then for the one *text*.npz in {os.fspath(p.parent)}); "
        f"put the pair in one folder as {VISION_NPZ} + {TEXT_NPZ} and pass the folder"
      )
    return InitSource("tips_npz", given, os.fspath(p), text)
  if p.is_dir():
    if (p / VISION_NPZ).is_file() and (p / TEXT_NPZ).is_file():
      return InitSource("tips_npz", given, os.fspath(p / VISION_NPZ), os.fspath(p / TEXT_NPZ))
    cfg = _json(p / "config.json") if (p / "config.json").is_file() else None
    if cfg is not None:
      model_type = cfg.get("model_type")
      if model_type in ("tipsv2", "clip"):
        return InitSource(f"hf_{model_type}", given)
      if "format_version" in cfg and "recipe" not in cfg and (p / "params").is_dir():
        return InitSource("export", given)
      if "recipe" in cfg:
        return InitSource("workdir", given)
    if (p / "checkpoints").is_dir() or p.name == "checkpoints" or _is_step_folder(p):
      return InitSource("workdir", given)
  raise InitSourceError(f"{key}={given!r}: {_found(p)}; {WHAT_IT_TAKES}")


def tokenizer_of(src: InitSource) -> Optional[str]:
  """The SentencePiece file that comes with a source, when it has one: an export's or a Hugging Face
  folder's `tokenizer.model`, a workdir's `config.tokenizer`, a `tokenizer.model` beside TIPS weights."""
  p = paths.as_path(src.path)
  if src.kind == "tips_npz":
    p = paths.as_path(src.image_npz).parent
  if src.kind == "workdir":
    for d in (p, p.parent, p.parent.parent):
      cfg = _json(d / "config.json") if (d / "config.json").is_file() else None
      if cfg is not None and "recipe" in cfg:
        return cfg.get("tokenizer")
    return None
  if src.kind == "export":
    cfg = _json(p / "config.json") or {}
    name = cfg.get("tokenizer")
    return os.fspath(p / name) if name and (p / name).is_file() else None
  return os.fspath(p / TOKENIZER) if (p / TOKENIZER).is_file() else None
