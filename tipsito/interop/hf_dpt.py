"""A Hugging Face `tipsv2_dpt` folder: a frozen TIPS-style image tower with DPT heads, written and read.

Why: the TIPSv2 release ships its dense heads as such folders (transformers >= 5.24:
`Tipsv2DptForDepthEstimation`, `...ForNormalEstimation`, `...ForSemanticSegmentation` and
`...ForDensePrediction`, which runs all three). Writing one lets a head trained by `python -m
tipsito.dense.train` run in transformers; reading one lets tipsito evaluate or fine-tune a released head.

The layout is the one the hub checkpoints use, which is also what `save_pretrained` writes (transformers
renames it to its module names at load time, tipsito/interop/hf_tipsv2.py explains why that layout is
the stable one):
  * `vision_encoder.*`: the image tower in the official TIPS PyTorch names, exactly as `--format
    hf_tipsv2` writes it (the second CLS token is the register token; layer scale written as ones);
  * `{task}_head.*` per head, task in depth / normals / segmentation: `reassemble.readout_projects.{i}`,
    `reassemble.out_projections.{i}`, `reassemble.resize_layers.{i}` (factor != 1), `convs.{i}`,
    `fusion_blocks.{j}.{residual_unit,main_unit}.conv{1,2}`, `fusion_blocks.{j}.out_conv`, `project`,
    `{task}_head.{task}_head` (the per-pixel linear layer).
One folder holds any set of heads; each per-task class ignores the other heads' tensors
(`_keys_to_ignore_on_load_unexpected`), so the same folder opens as any class whose head it holds.
`config.json` is a `Tipsv2DptConfig` (`backbone_config` with `out_indices` = the DPT's tower stages,
`apply_layernorm` true, `reshape_hidden_states` false) under which transformers computes what
tipsito/models/dpt.py computes; `preprocessor_config.json` is the `Tipsv2DptImageProcessor`'s, with the
tower's pixel statistics.

Reading is strict, as for Tipsv2 folders: JSON and safetensors only (never a pickle), every tensor used,
none missing, every shape checked; a layer scale other than ones is folded into the projection before it.
Writing then reading is bit-exact (transposes and reshapes only; tests/test_dense_dpt.py).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from tipsito import paths
from tipsito.models import dpt as dpt_lib
from tipsito.interop import hf_tipsv2
from tipsito.interop.tips_npz import NotRepresentableError

MODEL_TYPE = 'tipsv2_dpt'
ARCHITECTURES = {
  'depth': 'Tipsv2DptForDepthEstimation',
  'normals': 'Tipsv2DptForNormalEstimation',
  'segmentation': 'Tipsv2DptForSemanticSegmentation',
}
DENSE_ARCHITECTURE = 'Tipsv2DptForDensePrediction'
CheckpointFormatError = hf_tipsv2.CheckpointFormatError
# What a TIPS-style tower must be for Tipsv2's vision model to compute it (tipsito/models/vit.py fields).
_TIPS_TOWER = dict(patch_bias=True, cls_posemb=False, pre_norm=False, activation='gelu', scan=False)


def _check_tower(image_config: Mapping[str, Any]) -> None:
  for k, want in _TIPS_TOWER.items():
    if k in image_config and image_config[k] != want:
      raise NotRepresentableError(
        f'tipsv2_dpt: image_config.{k} is {image_config[k]!r}; a Tipsv2 backbone needs {want!r} '
        '(a TIPS-style tower: recipes tips, tipsv2, tipsito, distill, or imported TIPS weights)'
      )
  if float(image_config['ln_eps']) != hf_tipsv2.LN_EPS:
    raise NotRepresentableError(f"tipsv2_dpt: image_config.ln_eps {image_config['ln_eps']}, Tipsv2 uses 1e-6")


# Fake text tower of depth 0: lets hf_tipsv2's tower conversion (which maps both towers) map the image
# tower alone; its tensors are dropped on writing and supplied on reading.
def _no_text(width: int) -> tuple[dict, dict, dict]:
  cfg = dict(width=width, depth=0, vocab_size=1, num_heads=1, mlp_dim=1)
  params = {'token_emb': {'embedding': np.zeros((1, width), np.float32)}}
  params['norm'] = {'scale': np.ones((width,), np.float32), 'bias': np.zeros((width,), np.float32)}
  state = {
    hf_tipsv2._T + 'token_embedding.weight': params['token_emb']['embedding'],  # pylint: disable=protected-access
    hf_tipsv2._T + 'ln_final.weight': params['norm']['scale'],  # pylint: disable=protected-access
    hf_tipsv2._T + 'ln_final.bias': params['norm']['bias'],  # pylint: disable=protected-access
  }
  return cfg, params, state


def tower_to_hub(image_config: Mapping[str, Any], image_params: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """The image tower's `vision_encoder.*` tensors (hf_tipsv2.to_hub_state's mapping)."""
  _check_tower(image_config)
  tcfg, tparams, _ = _no_text(int(image_config['width']))
  sd = hf_tipsv2.to_hub_state(image_config, tcfg, {'image': image_params, 'text': tparams})
  return {k: v for k, v in sd.items() if k.startswith(hf_tipsv2._V)}  # pylint: disable=protected-access


def _c(x) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x, np.float32))


def _conv_w(k) -> np.ndarray:
  """Flax conv kernel (kh, kw, in, out) -> torch Conv2d weight (out, in, kh, kw)."""
  return np.asarray(k).transpose(3, 2, 0, 1)


def _head_names(cfg: dpt_lib.DPTConfig, task: str):
  """(flax path, hub name, kind) of every tensor of one head; kind says how the kernel is laid out."""
  pre = f'{task}_head.'
  rows = []
  for i, f in enumerate(cfg.reassemble_factors):
    rows.append((f'readout_{i}', f'{pre}reassemble.readout_projects.{i}', 'dense'))
    rows.append((f'reassemble_{i}_projection', f'{pre}reassemble.out_projections.{i}', 'conv'))
    if f != 1:
      rows.append(
        (f'reassemble_{i}_resize', f'{pre}reassemble.resize_layers.{i}', 'tile' if f > 1 else 'conv')
      )
    rows.append((f'conv_{i}', f'{pre}convs.{i}', 'conv_nobias'))
  for j in range(len(cfg.neck_hidden_sizes)):
    units = [('residual1', 'residual_unit')] if j > 0 else []
    for ours, theirs in units + [('residual2', 'main_unit')]:
      for c in ('conv1', 'conv2'):
        rows.append((f'fusion_{j}/{ours}/{c}', f'{pre}fusion_blocks.{j}.{theirs}.{c}', 'conv_nobias'))
    rows.append((f'fusion_{j}/projection', f'{pre}fusion_blocks.{j}.out_conv', 'conv'))
  rows.append(('decoder_project', f'{pre}project', 'conv'))
  rows.append(('decoder_head', f'{pre}{task}_head', 'dense'))
  return rows


def head_to_hub(cfg: dpt_lib.DPTConfig, task: str, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """One DPT head's Flax params -> its hub tensors (transposes only); refuses params left over."""
  flat = hf_tipsv2._flat(params)  # pylint: disable=protected-access
  used, sd = set(), {}
  for ours, theirs, kind in _head_names(cfg, task):
    k = flat[f'{ours}/kernel']
    used.add(f'{ours}/kernel')
    if kind == 'dense':
      w = k.T
    elif kind == 'tile':
      w = k.transpose(2, 3, 0, 1)  # (f, f, in, out) -> torch ConvTranspose2d (in, out, f, f)
    else:
      w = _conv_w(k)
    sd[theirs + '.weight'] = _c(w)
    if kind != 'conv_nobias':
      sd[theirs + '.bias'] = _c(flat[f'{ours}/bias'])
      used.add(f'{ours}/bias')
  left = sorted(set(flat) - used)
  if left:
    raise NotRepresentableError(f'tipsv2_dpt: {task} head params {left} have no place in a Tipsv2Dpt head')
  return sd


def head_from_hub(take, cfg: dpt_lib.DPTConfig, task: str, width: int) -> dict:
  """The inverse of `head_to_hub` for the tensors `take` pops (shapes checked against `cfg`)."""
  from flax import traverse_util  # pylint: disable=g-import-not-at-top

  f_, nl = cfg.fusion_hidden_size, len(cfg.neck_hidden_sizes)
  shapes = {}
  for i, (ch, fac) in enumerate(zip(cfg.neck_hidden_sizes, cfg.reassemble_factors)):
    shapes[f'readout_{i}'] = (width, 2 * width)
    shapes[f'reassemble_{i}_projection'] = (ch, width, 1, 1)
    if fac > 1:
      shapes[f'reassemble_{i}_resize'] = (ch, ch, int(fac), int(fac))
    elif fac < 1:
      shapes[f'reassemble_{i}_resize'] = (ch, ch, 3, 3)
    shapes[f'conv_{i}'] = (f_, ch, 3, 3)
  for j in range(nl):
    for u in ('residual1', 'residual2'):
      for c in ('conv1', 'conv2'):
        shapes[f'fusion_{j}/{u}/{c}'] = (f_, f_, 3, 3)
    shapes[f'fusion_{j}/projection'] = (f_, f_, 1, 1)
  shapes['decoder_project'] = (f_, f_, 3, 3)
  shapes['decoder_head'] = (dpt_lib.out_channels(cfg, task), f_)
  flat = {}
  for ours, theirs, kind in _head_names(cfg, task):
    w = take(theirs + '.weight', shapes[ours])
    if kind == 'dense':
      k = w.T
    elif kind == 'tile':
      k = w.transpose(2, 3, 0, 1)
    else:
      k = w.transpose(2, 3, 1, 0)
    flat[f'{ours}/kernel'] = np.ascontiguousarray(k)
    if kind != 'conv_nobias':
      flat[f'{ours}/bias'] = take(theirs + '.bias', (shapes[ours][0],))
  return traverse_util.unflatten_dict(flat, sep='/')


def hf_config(
  image_config: Mapping[str, Any],
  cfg: dpt_lib.DPTConfig,
  tasks: Sequence[str],
  label_names: Optional[Sequence[str]] = None,
) -> dict:
  """The `Tipsv2DptConfig` (config.json) under which transformers computes tipsito's heads."""
  vision = hf_tipsv2.hf_config(image_config, dict(_no_text(1)[0], max_len=1), 1.0)['vision_config']
  stages = cfg.stages(int(image_config['depth']))
  vision.update(out_indices=list(stages), apply_layernorm=True, reshape_hidden_states=False)
  names = list(label_names) if label_names else [f'LABEL_{i}' for i in range(cfg.num_labels)]
  if len(names) != cfg.num_labels:
    raise ValueError(f'tipsv2_dpt: {len(names)} label names for {cfg.num_labels} labels')
  archs = [ARCHITECTURES[t] for t in tasks] if len(tasks) == 1 else [DENSE_ARCHITECTURE]
  return dict(
    architectures=archs,
    model_type=MODEL_TYPE,
    dtype='float32',
    backbone_config=vision,
    neck_hidden_sizes=list(cfg.neck_hidden_sizes),
    fusion_hidden_size=int(cfg.fusion_hidden_size),
    reassemble_factors=[int(f) if float(f).is_integer() else float(f) for f in cfg.reassemble_factors],
    readout_activation=cfg.readout_activation,
    num_depth_bins=int(cfg.num_depth_bins),
    min_depth=float(cfg.min_depth),
    max_depth=float(cfg.max_depth),
    depth_decoder_activation=cfg.depth_decoder_activation,
    semantic_loss_ignore_index=int(cfg.semantic_loss_ignore_index),
    id2label={str(i): n for i, n in enumerate(names)},
    label2id={n: i for i, n in enumerate(names)},
  )


def write_hf_dpt(
  output_dir,
  *,
  image_config: Mapping[str, Any],
  image_params: Mapping[str, Any],
  cfg: dpt_lib.DPTConfig,
  heads: Mapping[str, Any],
  image_size: Optional[int] = None,
  label_names: Optional[Sequence[str]] = None,
) -> str:
  """Writes the tower and `heads` ({task: params}) as a folder `Tipsv2DptFor*.from_pretrained` opens.

  Everything is converted (and refused, with the reason) before the folder is created.
  """
  import safetensors.numpy as st  # optional dependency: safetensors  # pylint: disable=g-import-not-at-top

  if not heads:
    raise ValueError('tipsv2_dpt: no heads to write')
  tasks = [t for t in dpt_lib.TASKS if t in heads]
  unknown = sorted(set(heads) - set(tasks))
  if unknown:
    raise ValueError(f'tipsv2_dpt: unknown head tasks {unknown} (known: {list(dpt_lib.TASKS)})')
  sd = tower_to_hub(image_config, image_params)
  for t in tasks:
    sd.update(head_to_hub(cfg, t, heads[t]))
  config = hf_config(image_config, cfg, tasks, label_names)
  size = int(image_size or hf_tipsv2._grid(image_config) * int(image_config['patch_size']))  # pylint: disable=protected-access
  pre = hf_tipsv2.preprocessor_config(image_config, size)
  pre.update(image_processor_type='Tipsv2DptImageProcessor', resample=2)  # the DPT processor's bilinear
  out = paths.as_path(output_dir)
  out.mkdir(parents=True, exist_ok=True)
  st.save_file(sd, os.fspath(out / hf_tipsv2.WEIGHTS_FILE), metadata={'format': 'pt'})
  (out / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
  (out / 'preprocessor_config.json').write_text(json.dumps(pre, indent=2) + '\n')
  return os.fspath(out)


def dpt_config_from_hf(cfg: Mapping[str, Any]) -> dpt_lib.DPTConfig:
  """tipsito's DPTConfig from a Tipsv2DptConfig dict (its defaults for keys left out)."""
  bb = dict(cfg.get('backbone_config') or {})
  if not bb.get('apply_layernorm', True):
    raise CheckpointFormatError('backbone_config.apply_layernorm is false; tipsito reads normed blocks')
  labels = cfg.get('id2label')
  num_labels = len(labels) if labels else int(cfg.get('num_labels', 2))
  out_indices = bb.get('out_indices') or [3, 6, 9, 12]
  return dpt_lib.DPTConfig(
    layers=tuple(int(i) for i in out_indices),
    neck_hidden_sizes=tuple(cfg.get('neck_hidden_sizes') or (96, 192, 384, 768)),
    fusion_hidden_size=int(cfg.get('fusion_hidden_size', 256)),
    reassemble_factors=tuple(cfg.get('reassemble_factors') or (4, 2, 1, 0.5)),
    readout_activation=cfg.get('readout_activation', 'gelu_pytorch_tanh'),
    num_depth_bins=int(cfg.get('num_depth_bins', 256)),
    min_depth=float(cfg.get('min_depth', 0.001)),
    max_depth=float(cfg.get('max_depth', 10.0)),
    depth_decoder_activation=cfg.get('depth_decoder_activation', 'relu'),
    num_labels=num_labels,
    semantic_loss_ignore_index=int(cfg.get('semantic_loss_ignore_index', 255)),
  )


def read_hf_dpt(path) -> dict[str, Any]:
  """Reads a local `tipsv2_dpt` folder: {'image_config', 'image_params', 'dpt_config', 'heads' ({task:
  params}), 'label_names', 'image_size', 'notes'} (numpy params)."""
  folder = paths.as_path(path)
  if not (folder / 'config.json').is_file():
    raise CheckpointFormatError(f'{os.fspath(folder)}: no config.json (not a Hugging Face model folder)')
  cfg = hf_tipsv2._read_json(folder / 'config.json', 'model config')  # pylint: disable=protected-access
  if cfg.get('model_type') != MODEL_TYPE:
    raise CheckpointFormatError(
      f"{os.fspath(folder)}: config.json model_type {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}"
    )
  pre_path = folder / 'preprocessor_config.json'
  pre = hf_tipsv2._read_json(pre_path, 'image processor') if pre_path.is_file() else {}  # pylint: disable=protected-access
  state = hf_tipsv2.read_state(folder)
  bb = dict(cfg.get('backbone_config') or {})
  icfg, _, notes = hf_tipsv2._tipsito_configs({'vision_config': bb, 'text_config': {}}, state, pre)  # pylint: disable=protected-access
  notes = [n for n in notes if not n.startswith('text_config')]
  dcfg = dpt_config_from_hf(cfg)
  dcfg.stages(icfg['depth'])
  tcfg, _, fake = _no_text(icfg['width'])
  take = hf_tipsv2._Taker({**state, **fake})  # pylint: disable=protected-access
  params = hf_tipsv2._from_hub(take, icfg, dict(tcfg, max_len=1))  # pylint: disable=protected-access
  heads = {}
  for t in dpt_lib.TASKS:
    if any(k.startswith(f'{t}_head.') for k in take.state):
      heads[t] = head_from_hub(take, dcfg, t, icfg['width'])
  if not heads:
    raise CheckpointFormatError(
      f'{os.fspath(folder)}: no depth_head / normals_head / segmentation_head tensors'
    )
  if take.state:
    raise CheckpointFormatError(
      f'{os.fspath(folder)}: unexpected tensors (not used by the architecture of config.json): '
      f'{sorted(take.state)[:8]}'
    )
  from tipsito.models import kwargs as kwargs_lib  # heavy: the flax tower modules  # pylint: disable=g-import-not-at-top

  icfg, _ = kwargs_lib.complete_tower_config(icfg, 'image', os.fspath(folder))
  labels = cfg.get('id2label') or {}
  size = pre.get('size') or {}
  return dict(
    image_config=icfg,
    image_params=params['image'],
    dpt_config=dcfg,
    heads=heads,
    label_names=[labels[str(i)] for i in range(len(labels))] if labels else None,
    image_size=int(size['height']) if isinstance(size, dict) and size.get('height') else None,
    notes=notes,
  )
