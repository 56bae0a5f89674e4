"""Continue pretraining a released or trained model (docs/finetuning.md): the towers and the tokenizer from
the model, the recipe, data, heads, schedule and learning rate yours.

    python -m tipsito.train --config configs/finetune.py:from=E,recipe=tipsv2 --workdir W \\
      --config.data.name=my_pairs --config.data.data_dir=/data/tfds

`from` is anything `config.init_from` takes (tipsito/config/init_source.py): a tipsito export (e.g. the
one `python -m tipsito.export --tips_image_npz V --tips_text_npz T --output E` makes of the released
TIPS / TIPSv2 weights), the official `.npz` pair itself (the vision file, or a folder with vision.npz +
text.npz), a Hugging Face Tipsv2 folder, or a training workdir. Every architecture key of both towers
(patch, width, depth, heads, MLP and its kind, CLS count, position grid, pixel statistics; vocabulary,
text width, depth, heads, MLP, flavour, max length) is set from the source (tipsito/interop/sources.py
`towers_of`: config files and array headers, no weights read, except for Hugging Face folders), and
`config.tokenizer` to the SentencePiece file the source ships (an export's or folder's
`tokenizer.model`, a `tokenizer.model` beside the .npz files, a workdir's `config.tokenizer`), unless
`tokenizer=` names one. The run then loads the towers bit for bit; the training-only parts (DINO / iBOT
heads, mask token, fusion, EMA, centres) start fresh, and the temperature carries over.

Args (k=v,...): from, recipe ('tipsv2' | 'tips' | 'tipsito'), steps, batch, size (global crop px, a
multiple of the patch; 0 = the size the source was trained or released at when it says, else 224),
lr, warmup, heads_lr (multiplier of lr for the fresh DINO / iBOT heads and the fusion), tokenizer,
data ('' = your `--config.data.*`; 'scenes' = the built-in testbed built into `<workdir>/data`, with
its dense evals, for trying the path on small towers).

The adaptation defaults, and why (the papers give no learning rate; tipsito's own choices are marked):
  * lr 2e-4 peak with 500 warm-up steps, cosine: the high-resolution adaptation stage of TIPSv2
    (TIPSv2 §4: a 9k-step stage that adapts the 90k-step model; tipsito/config/paper.py
    `high_resolution_stage`, 1/5 of stage 1's 1e-3 and 500 warm-up steps, our inference). Starting from
    trained towers, a full stage-1 peak would first undo them; the warm-up keeps the first steps, whose
    gradients come from random heads, small.
  * heads_lr 5: the DINO / iBOT heads (and ITO's fusion) start from random weights while the towers are
    trained, so they get stage 1's peak (5 x 2e-4 = 1e-3, tipsito/config/paper.py `tipsv2`) through
    `optim.lr_mults` (our inference: heads trained from scratch at the rate they were trained with).
  * teacher temperature warm-up over the same 500 steps (0.04 -> 0.07, `loss_opts.warmup_teacher_temp`,
    docs/recipes.md): a fresh teacher head starts where DINO's does, but on a short schedule.
  * everything else is the recipe's (tipsito/config/recipes.py): Adafactor, clipping 1.0, the loss
    weights, multi-crop 1 x global + 6 local, mask ratio 0.75, head-only EMA for tipsv2.
"""

import importlib.util
import json
import pathlib

from tipsito.config import args
from tipsito.config import defaults
from tipsito.config import init_source
from tipsito.config import recipes

RECIPES = ("tipsv2", "tips", "tipsito")
HEADS_LR_REGEX = r"^(dino_head|ibot_head|fusion)/"


def get_config(arg=None):
  """The adaptation config of the model `from` (see the module docstring for the args)."""
  a = args.parse_arg(
    arg,
    **{
      "from": "",
      "recipe": "tipsv2",
      "steps": 2000,
      "batch": 256,
      "size": 0,
      "lr": 2e-4,
      "warmup": 500,
      "heads_lr": 5.0,
      "tokenizer": "",
      "data": "",
    },
  )
  args.check_choice("recipe", a.recipe, RECIPES)
  args.check_choice("data", a.data, ("", "scenes"))
  c = defaults.base_config(a.recipe, "B/14", total_steps=a.steps, batch_size=a.batch)
  image, text, tokenizer, trained_size = {}, {}, None, None
  if a["from"]:
    src = init_source.detect(a["from"], key="configs/finetune.py:from")
    from tipsito.interop import sources  # pylint: disable=g-import-not-at-top  # the readers, only with from=

    from tipsito.models import kwargs  # pylint: disable=g-import-not-at-top  # the towers' keys: JAX, as above

    image, text = sources.towers_of(src)
    tokenizer = init_source.tokenizer_of(src)
    trained_size = _trained_size(src)
    c.init_from = a["from"]
    # Everything that fixes the towers' params or what they compute (tipsito/models/kwargs.py).
    for k in kwargs.ARCHITECTURE_KEYS["image"]:
      if image.get(k) is not None:
        c.model.image[k] = tuple(image[k]) if isinstance(image[k], list) and k != "posemb_grid" else image[k]
    for k in kwargs.ARCHITECTURE_KEYS["text"]:
      if text.get(k) is not None:
        c.model.text[k] = text[k]
  if text.get("max_len"):
    c.max_len = int(text["max_len"])
  c.tokenizer = a.tokenizer or tokenizer
  patch = int(c.model.image.patch_size)
  size = a.size or trained_size or 224
  if size % patch:
    raise ValueError(f"configs/finetune.py: size={size} is not a multiple of the patch size {patch}")
  local = 140 if size >= 448 else max(patch, round(size * 98 / 224 / patch) * patch)  # TIPSv2's crops
  c.input.update(dict(global_size=size, local_size=local))
  c.optim.update(dict(lr=a.lr, warmup_steps=a.warmup))
  c.optim.lr_mults = {HEADS_LR_REGEX: a.heads_lr} if a.heads_lr != 1.0 else {}
  if "dino" in recipes.get_recipe(a.recipe).loss:
    c.loss_opts.teacher_temp_warmup_steps = a.warmup
  if a.data == "scenes":
    _scenes(c, size)
  return c


def _trained_size(src):
  """The image size an export or Hugging Face folder records (None for workdirs and .npz files)."""
  p = pathlib.Path(src.path).expanduser()
  try:
    if src.kind == "export":
      return (
        int((json.loads((p / "config.json").read_text()).get("extra") or {}).get("image_size") or 0) or None
      )
    if src.kind == "hf_tipsv2":
      pre = json.loads((p / "preprocessor_config.json").read_text())
      size = pre.get("size") or {}
      return int(size.get("height") or size.get("shortest_edge") or 0) or None
  except (OSError, ValueError):
    return None
  return None


def _scenes(c, size):
  """configs/demo.py's `scenes` data, tokenizer-free part: the testbed at `size` px and its dense evals."""
  path = pathlib.Path(__file__).with_name("demo.py")
  spec = importlib.util.spec_from_file_location("_finetune_demo", path)
  demo = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(demo)
  tokenizer = c.tokenizer
  demo._scenes_data(c, args.parse_arg(f"size={size}", size=64, evals=True))  # pylint: disable=protected-access
  c.tokenizer = tokenizer  # the source's: its text tower is sized for it
