"""`--format hf_clip` and `--format open_clip`: CLIP-style models (recipes clip, ito; siglip to open_clip)
as a Hugging Face `CLIPModel` folder and as an OpenCLIP checkpoint folder.

Why: the CLIP ecosystem opens these two. The CLIP/SigLIP/ITO towers are OpenCLIP's (tipsito/models/
presets.py: the 'openclip' structure), so both formats are a renaming plus fixed layout changes
(transposes, the conv kernel to NCHW, q/k/v split per head -> (D, D), OpenCLIP's fused in_proj); no
arithmetic. tests/test_models_openclip.py holds an independent table of the same mapping, which the tests
compare against what is written here, and a numpy forward written from OpenCLIP's and Hugging Face's
equations.

  * hf_clip: `model.safetensors` (HF `CLIPModel` names, `logit_scale` = ln(1 / T)), `config.json` under
    which HF computes what tipsito computes (`hidden_act` 'gelu' = exact erf GELU, tipsito's LayerNorm eps,
    `eos_token_id` = the clip tokenizer's EOT so that HF pools the token tipsito pools,
    `image_size` = position grid x patch: HF needs no interpolation there), `preprocessor_config.json`
    (CLIPImageProcessor: shorter side to the native size, centre crop, bicubic, the model's mean/std:
    tipsito's 'center_crop' eval resize) and the SentencePiece `tokenizer.model` (HF has no CLIP
    tokenizer for it: tokenize with tipsito, `tipsito.load(E).tokenize` or tipsito/data/tokenizer.py with
    flavour 'clip').
  * open_clip: `open_clip_model.safetensors` (OpenCLIP `CLIP` state dict: `visual.*`, top-level text tower,
    fused `in_proj_weight`, `logit_scale`, and `logit_bias` for SigLIP) and `open_clip_config.json`
    ({'model_cfg', 'preprocess_cfg'}) for `open_clip.create_model('local-dir:DIR')`, plus
    `tokenizer.model`.

Refused before anything is written, naming the reason and what to use: TIPS-style towers (two CLS tokens,
the TIPS text tower, patch bias, no ln_pre, no CLS position row), a model without both projections, and
for hf_clip a SigLIP model (its sigmoid logits need the bias CLIPModel does not have).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

import numpy as np

from tipsito import export_format
from tipsito.data import tokenizer as tok_lib
from tipsito.interop import hf_tipsv2
from tipsito.interop.hf_tipsv2 import _safetensors_numpy
from tipsito.interop.tips_npz import NotRepresentableError, _flat

HF_WEIGHTS_FILE = 'model.safetensors'
OPEN_CLIP_WEIGHTS_FILE = 'open_clip_model.safetensors'
OPEN_CLIP_CONFIG_FILE = 'open_clip_config.json'
TOKENIZER_FILE = 'tokenizer.model'
# tipsito activation (tipsito/models/layers.py: ACTIVATIONS) -> transformers ACT2FN name.
HF_ACT = {'gelu_exact': 'gelu', 'gelu': 'gelu_pytorch_tanh', 'quick_gelu': 'quick_gelu', 'relu': 'relu'}
OPENCLIP_LN_EPS = 1e-5  # torch.nn.LayerNorm's default, which OpenCLIP uses unless norm_kwargs say otherwise


def _grid(image_config: Mapping[str, Any], fmt: str) -> int:
  g = image_config['posemb_grid']
  if isinstance(g, (list, tuple)):
    if len(g) != 2 or int(g[0]) != int(g[1]):
      raise NotRepresentableError(
        f'--format {fmt}: position grid {list(g)} is not square; CLIP image towers have a square grid'
      )
    g = g[0]
  return int(g)


def _image_act(image_config) -> str:
  return image_config['activation']


def _text_act(text_config) -> str:
  """None: the 'clip' flavour's own (tipsito/models/text.py), the only flavour these formats take."""
  return text_config['activation'] or 'gelu_exact'


def _image_eps(image_config) -> float:
  return float(image_config['ln_eps'])


def _text_eps(text_config) -> float:
  """None: the 'clip' flavour's own (tipsito/models/text.py)."""
  return float(text_config['ln_eps'] or OPENCLIP_LN_EPS)


def is_siglip(extra: Optional[Mapping[str, Any]]) -> bool:
  """Whether the model was trained with the SigLIP recipe (the export's `extra.recipe`)."""
  return (extra or {}).get('recipe') == 'siglip'


def check_clip_style(
  image_config: Mapping[str, Any],
  text_config: Mapping[str, Any],
  params: Mapping[str, Any],
  fmt: str,
  extra: Optional[Mapping[str, Any]] = None,
) -> None:
  """Refuses what OpenCLIP's / HF's CLIP architecture cannot express, naming the reason and the way out."""
  tips_hint = (
    'TIPS-style models (recipes tips, tipsv2, tipsito, distill) go to --format hf_tipsv2 or tips_npz'
  )
  n_cls = int(image_config['num_cls_tokens'])
  if n_cls != 1:
    raise NotRepresentableError(
      f'--format {fmt}: the image tower has {n_cls} CLS tokens; CLIP has one class token. {tips_hint}.'
    )
  if text_config['flavour'] != 'clip':
    raise NotRepresentableError(
      f"--format {fmt}: the text tower is flavour {text_config['flavour']!r} (the TIPS text "
      f"tower: sinusoidal positions, mean pooling); CLIP's pools the EOT token. {tips_hint}."
    )
  if 'image_proj' not in params or text_config['out_dim'] is None:
    raise NotRepresentableError(
      f'--format {fmt}: CLIP needs an image projection and a text projection (this model has '
      f"image_proj: {'image_proj' in params}, text out_dim: {text_config['out_dim']})"
    )
  missing = [
    k
    for k, want in (('patch_bias', False), ('cls_posemb', True), ('pre_norm', True))
    if bool(image_config[k]) != want
  ]
  if missing:
    raise NotRepresentableError(
      f'--format {fmt}: the image tower is not OpenCLIP-shaped ({", ".join(missing)} differ from '
      "tipsito/config/presets.py IMAGE_STRUCTURE['openclip']). " + tips_hint + '.'
    )
  if image_config['ffn'] != 'mlp':
    raise NotRepresentableError(
      f"--format {fmt}: the image FFN is {image_config['ffn']!r}; CLIP's is a 2-layer MLP"
    )
  for tower, cfg in (('image', image_config), ('text', text_config)):
    if cfg['scan']:
      raise NotRepresentableError(
        f'--format {fmt}: the {tower} tower is scanned; exports are per-layer '
        '(tipsito/models/layer_stack.py: to_per_layer)'
      )
  proj = np.asarray(params['image_proj']['kernel'])
  if proj.shape[1] != int(text_config['out_dim']):
    raise NotRepresentableError(
      f'--format {fmt}: image embedding {proj.shape[1]} != text embedding {text_config["out_dim"]}'
    )
  _grid(image_config, fmt)
  for tower, act in (('image', _image_act(image_config)), ('text', _text_act(text_config))):
    if act not in HF_ACT:
      raise NotRepresentableError(f'--format {fmt}: {tower} activation {act!r} has no equivalent')
  if fmt == 'hf_clip' and is_siglip(extra):
    raise NotRepresentableError(
      '--format hf_clip: this is a SigLIP model (recipe siglip): its logits are sigmoid(cos * scale + '
      'bias) and CLIPModel has no bias (its softmax logits would drop it). Use --format open_clip (keeps '
      'logit_bias) or the tipsito export (--format tipsito).'
    )
  if fmt == 'open_clip':
    acts = {_image_act(image_config), _text_act(text_config)}
    if 'relu' in acts or len(acts) != 1:
      raise NotRepresentableError(
        f'--format open_clip: activations {sorted(acts)}; OpenCLIP uses one '
        'GELU (exact, tanh or quick) in both towers'
      )
    if is_siglip(extra) and (extra or {}).get('logit_bias') is None:
      raise NotRepresentableError(
        '--format open_clip: this is a SigLIP model but its logit bias is not known here (a tipsito '
        'export keeps the towers only); write it from the training workdir: --workdir W [--step N]'
      )


# --------------------------------------------------------------------------------------------------
# State dicts (tipsito per-layer params -> torch layouts)
# --------------------------------------------------------------------------------------------------


def _c(x) -> np.ndarray:
  """C-contiguous float32 (np.ascontiguousarray would turn a 0-d logit_scale into shape (1,))."""
  return np.array(x, np.float32, order='C')


class _Flat:
  """'/'-joined params; records which ones were taken, so that none is left over."""

  def __init__(self, tree):
    self.flat = _flat(tree)
    self.used = set()

  def __call__(self, key):
    self.used.add(key)
    return self.flat[key]

  def check(self, fmt):
    left = sorted(set(self.flat) - self.used)
    if left:
      raise NotRepresentableError(f'--format {fmt}: params {left[:6]} have no place in a CLIP model')


def _tower_blocks(get, prefix: str, depth: int, dim: int):
  """Per block: {norm1/2 (w, b), q/k/v (W (D, D) torch layout, b), out (W, b), fc1, fc2}."""
  out = []
  for i in range(depth):
    b = f'{prefix}block_{i}/'
    blk = {n: (get(f'{b}{n}/scale'), get(f'{b}{n}/bias')) for n in ('norm1', 'norm2')}
    for n in ('query', 'key', 'value'):
      blk[n] = (get(f'{b}attn/{n}/kernel').reshape(dim, dim).T, get(f'{b}attn/{n}/bias').reshape(dim))
    blk['out'] = (get(f'{b}attn/out/kernel').reshape(dim, dim).T, get(f'{b}attn/out/bias'))
    blk['fc1'] = (get(f'{b}mlp/Dense_0/kernel').T, get(f'{b}mlp/Dense_0/bias'))
    blk['fc2'] = (get(f'{b}mlp/Dense_1/kernel').T, get(f'{b}mlp/Dense_1/bias'))
    out.append(blk)
  return out


def _parts(image_config, text_config, params, fmt):
  """The CLIP parts of tipsito params (torch layouts where both formats agree)."""
  get = _Flat({'image': params['image'], 'text': params['text'], 'image_proj': params['image_proj']})
  d, dt = int(image_config['width']), int(text_config['width'])
  p = dict(
    patch=get('image/patch_embed/kernel').transpose(3, 2, 0, 1),
    cls=get('image/cls').reshape(d),
    pos=get('image/posemb').reshape(-1, d),
    ln_pre=(get('image/norm_pre/scale'), get('image/norm_pre/bias')),
    ln_post=(get('image/norm/scale'), get('image/norm/bias')),
    vblocks=_tower_blocks(get, 'image/', int(image_config['depth']), d),
    vproj=get('image_proj/kernel'),
    tok=get('text/token_emb/embedding'),
    tpos=get('text/posemb'),
    ln_final=(get('text/norm/scale'), get('text/norm/bias')),
    tblocks=_tower_blocks(get, 'text/', int(text_config['depth']), dt),
    tproj=get('text/proj/kernel'),
  )
  get.check(fmt)
  g = _grid(image_config, fmt)
  if p['pos'].shape[0] != 1 + g * g:
    raise NotRepresentableError(
      f"--format {fmt}: position table has {p['pos'].shape[0]} rows, expected 1 + {g}x{g}"
    )
  return p


def to_hf_clip_state(image_config, text_config, params, temperature: float) -> dict[str, np.ndarray]:
  """tipsito params -> Hugging Face `CLIPModel` state dict."""
  p = _parts(image_config, text_config, params, 'hf_clip')
  sd = {}
  v, t = 'vision_model.', 'text_model.'
  sd[v + 'embeddings.patch_embedding.weight'] = p['patch']
  sd[v + 'embeddings.class_embedding'] = p['cls']
  sd[v + 'embeddings.position_embedding.weight'] = p['pos']
  sd[v + 'pre_layrnorm.weight'], sd[v + 'pre_layrnorm.bias'] = p['ln_pre']
  sd[v + 'post_layernorm.weight'], sd[v + 'post_layernorm.bias'] = p['ln_post']
  sd[t + 'embeddings.token_embedding.weight'] = p['tok']
  sd[t + 'embeddings.position_embedding.weight'] = p['tpos']
  sd[t + 'final_layer_norm.weight'], sd[t + 'final_layer_norm.bias'] = p['ln_final']
  for pre, blocks in ((v, p['vblocks']), (t, p['tblocks'])):
    for i, blk in enumerate(blocks):
      o = f'{pre}encoder.layers.{i}.'
      for n, hf in (
        ('norm1', 'layer_norm1'),
        ('norm2', 'layer_norm2'),
        ('query', 'self_attn.q_proj'),
        ('key', 'self_attn.k_proj'),
        ('value', 'self_attn.v_proj'),
        ('out', 'self_attn.out_proj'),
        ('fc1', 'mlp.fc1'),
        ('fc2', 'mlp.fc2'),
      ):
        sd[f'{o}{hf}.weight'], sd[f'{o}{hf}.bias'] = blk[n]
  sd['visual_projection.weight'] = p['vproj'].T
  sd['text_projection.weight'] = p['tproj'].T
  sd['logit_scale'] = np.asarray(np.log(1.0 / float(temperature)), np.float32)
  return {k: _c(x) for k, x in sd.items()}


def to_open_clip_state(
  image_config, text_config, params, temperature: float, logit_bias: Optional[float] = None
) -> dict[str, np.ndarray]:
  """tipsito params -> OpenCLIP `CLIP` state dict (q/k/v fused into in_proj as nn.MultiheadAttention)."""
  p = _parts(image_config, text_config, params, 'open_clip')
  sd = {}
  sd['visual.conv1.weight'] = p['patch']
  sd['visual.class_embedding'] = p['cls']
  sd['visual.positional_embedding'] = p['pos']
  sd['visual.ln_pre.weight'], sd['visual.ln_pre.bias'] = p['ln_pre']
  sd['visual.ln_post.weight'], sd['visual.ln_post.bias'] = p['ln_post']
  sd['visual.proj'] = p['vproj']
  sd['token_embedding.weight'] = p['tok']
  sd['positional_embedding'] = p['tpos']
  sd['ln_final.weight'], sd['ln_final.bias'] = p['ln_final']
  sd['text_projection'] = p['tproj']
  for pre, blocks in (
    ('visual.transformer.resblocks.', p['vblocks']),
    ('transformer.resblocks.', p['tblocks']),
  ):
    for i, blk in enumerate(blocks):
      o = f'{pre}{i}.'
      sd[o + 'ln_1.weight'], sd[o + 'ln_1.bias'] = blk['norm1']
      sd[o + 'ln_2.weight'], sd[o + 'ln_2.bias'] = blk['norm2']
      sd[o + 'attn.in_proj_weight'] = np.concatenate([blk[n][0] for n in ('query', 'key', 'value')], 0)
      sd[o + 'attn.in_proj_bias'] = np.concatenate([blk[n][1] for n in ('query', 'key', 'value')], 0)
      sd[o + 'attn.out_proj.weight'], sd[o + 'attn.out_proj.bias'] = blk['out']
      sd[o + 'mlp.c_fc.weight'], sd[o + 'mlp.c_fc.bias'] = blk['fc1']
      sd[o + 'mlp.c_proj.weight'], sd[o + 'mlp.c_proj.bias'] = blk['fc2']
  sd['logit_scale'] = np.asarray(np.log(1.0 / float(temperature)), np.float32)
  if logit_bias is not None:
    sd['logit_bias'] = np.asarray(logit_bias, np.float32)
  return {k: _c(x) for k, x in sd.items()}


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------


def _eot_id(text_config, tokenizer_path) -> int:
  """The clip tokenizer's EOT id (SentencePiece size + 1); without a tokenizer file, the largest id."""
  if tokenizer_path:
    return int(tok_lib.Tokenizer(tokenizer_path, max_len=2, flavour='clip').eot_id)
  return int(text_config['vocab_size']) - 1


def _mlp_ratio(width: int, mlp_dim: int, fmt: str) -> float:
  r = mlp_dim / width
  if int(width * r) != mlp_dim:
    raise NotRepresentableError(f'--format {fmt}: no mlp_ratio gives an MLP of {mlp_dim} for width {width}')
  return int(r) if r == int(r) else r


def hf_clip_config(image_config, text_config, temperature: float, tokenizer_path=None) -> dict:
  """The `CLIPConfig` (config.json) under which `CLIPModel` computes what tipsito computes."""
  patch, embed = int(image_config['patch_size']), int(text_config['out_dim'])
  eot = _eot_id(text_config, tokenizer_path)
  vision = dict(
    model_type='clip_vision_model',
    hidden_size=int(image_config['width']),
    intermediate_size=int(image_config['mlp_dim']),
    projection_dim=embed,
    num_hidden_layers=int(image_config['depth']),
    num_attention_heads=int(image_config['num_heads']),
    num_channels=3,
    image_size=_grid(image_config, 'hf_clip') * patch,
    patch_size=patch,
    hidden_act=HF_ACT[_image_act(image_config)],
    layer_norm_eps=_image_eps(image_config),
    attention_dropout=0.0,
  )
  text = dict(
    model_type='clip_text_model',
    vocab_size=int(text_config['vocab_size']),
    hidden_size=int(text_config['width']),
    intermediate_size=int(text_config['mlp_dim']),
    projection_dim=embed,
    num_hidden_layers=int(text_config['depth']),
    num_attention_heads=int(text_config['num_heads']),
    max_position_embeddings=int(text_config['max_len']),
    hidden_act=HF_ACT[_text_act(text_config)],
    layer_norm_eps=_text_eps(text_config),
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=eot - 1,
    eos_token_id=eot,
  )
  return dict(
    architectures=['CLIPModel'],
    model_type='clip',
    dtype='float32',
    projection_dim=embed,
    logit_scale_init_value=float(np.log(1.0 / float(temperature))),
    text_config=text,
    vision_config=vision,
  )


def hf_preprocessor_config(image_config, size: int) -> dict:
  """`CLIPImageProcessor`: shorter side to `size`, centre crop, bicubic, /255, the model's mean/std."""
  return dict(
    image_processor_type='CLIPImageProcessor',
    do_resize=True,
    size={'shortest_edge': int(size)},
    resample=3,
    do_center_crop=True,
    crop_size={'height': int(size), 'width': int(size)},
    do_rescale=True,
    rescale_factor=1 / 255,
    do_normalize=True,
    image_mean=[float(x) for x in image_config['pixel_mean']],
    image_std=[float(x) for x in image_config['pixel_std']],
    do_convert_rgb=True,
  )


def open_clip_config(
  image_config, text_config, temperature: float, tokenizer_path=None, logit_bias: Optional[float] = None
) -> dict:
  """`open_clip_config.json`: {'model_cfg' (CLIP(**model_cfg)), 'preprocess_cfg'}."""
  width, twidth = int(image_config['width']), int(text_config['width'])
  act = _image_act(image_config)
  vision = dict(
    image_size=_grid(image_config, 'open_clip') * int(image_config['patch_size']),
    layers=int(image_config['depth']),
    width=width,
    head_width=width // int(image_config['num_heads']),
    mlp_ratio=_mlp_ratio(width, int(image_config['mlp_dim']), 'open_clip'),
    patch_size=int(image_config['patch_size']),
  )
  text = dict(
    context_length=int(text_config['max_len']),
    vocab_size=int(text_config['vocab_size']),
    width=twidth,
    heads=int(text_config['num_heads']),
    layers=int(text_config['depth']),
    mlp_ratio=_mlp_ratio(twidth, int(text_config['mlp_dim']), 'open_clip'),
    pad_id=0,
    eos_id=_eot_id(text_config, tokenizer_path),
    pool_type='argmax',
  )
  for cfg, eps in ((vision, _image_eps(image_config)), (text, _text_eps(text_config))):
    if eps != OPENCLIP_LN_EPS:
      cfg['norm_kwargs'] = {'eps': eps}
    if act == 'gelu':  # tanh GELU: nn.GELU(approximate='tanh')
      cfg['act_kwargs'] = {'approximate': 'tanh'}
  model = dict(
    embed_dim=int(text_config['out_dim']),
    vision_cfg=vision,
    text_cfg=text,
    init_logit_scale=float(np.log(1.0 / float(temperature))),
  )
  if act == 'quick_gelu':
    model['quick_gelu'] = True
  if logit_bias is not None:
    model['init_logit_bias'] = float(logit_bias)
  size = vision['image_size']
  pre = dict(
    size=size,
    mode='RGB',
    mean=[float(x) for x in image_config['pixel_mean']],
    std=[float(x) for x in image_config['pixel_std']],
    interpolation='bicubic',
    resize_mode='shortest',
    fill_color=0,
  )
  return dict(model_cfg=model, preprocess_cfg=pre)


# --------------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------------


def _write(out_dir, files: dict[str, bytes], tokenizer_path) -> str:
  from etils import epath  # pylint: disable=g-import-not-at-top

  out = export_format.as_path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  for name, data in files.items():
    (out / name).write_bytes(data)
  if tokenizer_path:
    (out / TOKENIZER_FILE).write_bytes(epath.Path(os.fspath(tokenizer_path)).read_bytes())
  return os.fspath(out)


def _json(d) -> bytes:
  return json.dumps(d, indent=2, sort_keys=True).encode()


def write_hf_clip(
  output_dir, *, image_config, text_config, params, temperature: float, tokenizer_path=None, extra=None
) -> str:
  """Writes a folder `transformers.CLIPModel.from_pretrained(output_dir)` opens offline.

  The image processor's size is the position table's native size (grid x patch), the only one CLIPModel
  takes without `interpolate_pos_encoding` (and the one OpenCLIP's preprocessing uses); the CLIP-style
  recipes train there (224 px for ViT-B/16's 14 x 14 grid).
  """
  st = _safetensors_numpy()
  check_clip_style(image_config, text_config, params, 'hf_clip', extra)
  cfg = hf_clip_config(image_config, text_config, temperature, tokenizer_path)
  state = to_hf_clip_state(image_config, text_config, params, temperature)
  size = cfg['vision_config']['image_size']
  return _write(
    output_dir,
    {
      HF_WEIGHTS_FILE: st.save(state, metadata={'format': 'pt'}),
      'config.json': _json(cfg),
      'preprocessor_config.json': _json(hf_preprocessor_config(image_config, size)),
    },
    tokenizer_path,
  )


def write_open_clip(
  output_dir, *, image_config, text_config, params, temperature: float, tokenizer_path=None, extra=None
) -> str:
  """Writes `open_clip_model.safetensors` + `open_clip_config.json` for
  `open_clip.create_model('local-dir:' + output_dir)`."""
  st = _safetensors_numpy()
  check_clip_style(image_config, text_config, params, 'open_clip', extra)
  bias = (extra or {}).get('logit_bias') if is_siglip(extra) else None
  cfg = open_clip_config(image_config, text_config, temperature, tokenizer_path, bias)
  state = to_open_clip_state(image_config, text_config, params, temperature, bias)
  return _write(
    output_dir,
    {OPEN_CLIP_WEIGHTS_FILE: st.save(state, metadata={'format': 'pt'}), OPEN_CLIP_CONFIG_FILE: _json(cfg)},
    tokenizer_path,
  )


# --------------------------------------------------------------------------------------------------
# Reading a Hugging Face CLIPModel folder (config.init_from, `export --from`-style sources)
# --------------------------------------------------------------------------------------------------


def read_hf_clip(path) -> dict[str, Any]:
  """{image_config, text_config, params (per-layer numpy), temperature, tokenizer_path, image_size} of
  a Hugging Face `CLIPModel` folder: the inverse of `write_hf_clip` (the same renaming and layout changes
  backwards, so tipsito -> hf_clip -> tipsito is bitwise).

  Only safetensors are read (hf_tipsv2.read_state: a pickle is never opened); every tensor must be used
  (HF's `position_ids` buffers excepted), and the config must be one tipsito computes (its activations
  and the OpenCLIP-shaped towers of tipsito/config/presets.py IMAGE_STRUCTURE['openclip']).
  """
  folder = export_format.as_path(path)
  where = os.fspath(folder)
  state = {k: v for k, v in hf_tipsv2.read_state(folder).items() if not k.endswith('position_ids')}
  cfg = json.loads((folder / 'config.json').read_text())
  vc, tc = dict(cfg.get('vision_config') or {}), dict(cfg.get('text_config') or {})
  for what, c, keys in (
    (
      'vision_config',
      vc,
      (
        'hidden_size',
        'patch_size',
        'image_size',
        'num_hidden_layers',
        'num_attention_heads',
        'intermediate_size',
      ),
    ),
    (
      'text_config',
      tc,
      (
        'hidden_size',
        'vocab_size',
        'max_position_embeddings',
        'num_hidden_layers',
        'num_attention_heads',
        'intermediate_size',
      ),
    ),
  ):
    missing = [k for k in keys if k not in c]
    if missing:
      raise ValueError(
        f'{where}/config.json: {what} has no {missing} (every CLIPConfig tipsito writes states them)'
      )
  acts = {v: k for k, v in HF_ACT.items()}
  for what, c in (('vision_config', vc), ('text_config', tc)):
    if c.get('hidden_act', 'quick_gelu') not in acts:
      raise ValueError(f"{where}: {what}.hidden_act {c.get('hidden_act')!r} has no tipsito equivalent")
  pre = folder / 'preprocessor_config.json'
  pre = json.loads(pre.read_text()) if pre.is_file() else {}
  d, dt = int(vc['hidden_size']), int(tc['hidden_size'])
  patch, size = int(vc['patch_size']), int(vc['image_size'])
  image = dict(
    patch_size=patch,
    width=d,
    depth=int(vc['num_hidden_layers']),
    num_heads=int(vc['num_attention_heads']),
    mlp_dim=int(vc['intermediate_size']),
    ffn='mlp',
    num_cls_tokens=1,
    posemb_grid=size // patch,
    pixel_mean=[float(x) for x in pre.get('image_mean', [0.48145466, 0.4578275, 0.40821073])],
    pixel_std=[float(x) for x in pre.get('image_std', [0.26862954, 0.26130258, 0.27577711])],
    activation=acts[vc.get('hidden_act', 'quick_gelu')],
    ln_eps=float(vc.get('layer_norm_eps', 1e-5)),
    patch_bias=False,
    cls_posemb=True,
    pre_norm=True,
  )
  text = dict(
    flavour='clip',
    vocab_size=int(tc['vocab_size']),
    max_len=int(tc['max_position_embeddings']),
    width=dt,
    depth=int(tc['num_hidden_layers']),
    num_heads=int(tc['num_attention_heads']),
    mlp_dim=int(tc['intermediate_size']),
    out_dim=int(cfg.get('projection_dim') or tc.get('projection_dim')),
    activation=acts[tc.get('hidden_act', 'quick_gelu')],
    ln_eps=float(tc.get('layer_norm_eps', 1e-5)),
  )
  used = set()

  def take(key):
    if key not in state:
      raise ValueError(f'{where}: {key} is not in the weights (not a CLIPModel as tipsito writes it)')
    used.add(key)
    return np.asarray(state[key], np.float32)

  def blocks(pre, depth, dim, heads):
    out = {}
    hd = dim // heads
    for i in range(depth):
      o = f'{pre}encoder.layers.{i}.'
      blk = {}
      for n, hf in (('norm1', 'layer_norm1'), ('norm2', 'layer_norm2')):
        blk[n] = {'scale': take(f'{o}{hf}.weight'), 'bias': take(f'{o}{hf}.bias')}
      attn = {}
      for n, hf in (('query', 'q_proj'), ('key', 'k_proj'), ('value', 'v_proj')):
        w, b = take(f'{o}self_attn.{hf}.weight'), take(f'{o}self_attn.{hf}.bias')
        attn[n] = {'kernel': w.T.reshape(dim, heads, hd), 'bias': b.reshape(heads, hd)}
      w = take(f'{o}self_attn.out_proj.weight')
      attn['out'] = {'kernel': w.T.reshape(heads, hd, dim), 'bias': take(f'{o}self_attn.out_proj.bias')}
      blk['attn'] = attn
      blk['mlp'] = {
        f'Dense_{j}': {'kernel': take(f'{o}mlp.fc{j + 1}.weight').T, 'bias': take(f'{o}mlp.fc{j + 1}.bias')}
        for j in (0, 1)
      }
      out[f'block_{i}'] = blk
    return out

  v, t = 'vision_model.', 'text_model.'
  image_params = {
    'patch_embed': {'kernel': take(v + 'embeddings.patch_embedding.weight').transpose(2, 3, 1, 0)},
    'cls': take(v + 'embeddings.class_embedding').reshape(1, 1, d),
    'posemb': take(v + 'embeddings.position_embedding.weight'),
    'norm_pre': {'scale': take(v + 'pre_layrnorm.weight'), 'bias': take(v + 'pre_layrnorm.bias')},
    'norm': {'scale': take(v + 'post_layernorm.weight'), 'bias': take(v + 'post_layernorm.bias')},
    **blocks(v, image['depth'], d, image['num_heads']),
  }
  text_params = {
    'token_emb': {'embedding': take(t + 'embeddings.token_embedding.weight')},
    'posemb': take(t + 'embeddings.position_embedding.weight'),
    'norm': {'scale': take(t + 'final_layer_norm.weight'), 'bias': take(t + 'final_layer_norm.bias')},
    'proj': {'kernel': take('text_projection.weight').T},
    **blocks(t, text['depth'], dt, text['num_heads']),
  }
  params = {
    'image': image_params,
    'text': text_params,
    'image_proj': {'kernel': take('visual_projection.weight').T},
  }
  temperature = float(1.0 / np.exp(np.float64(take('logit_scale'))))
  left = sorted(set(state) - used)
  if left:
    raise ValueError(f'{where}: tensors {left[:6]} have no place in a tipsito CLIP model')
  tok = folder / TOKENIZER_FILE
  return dict(
    image_config=image,
    text_config=text,
    params=_own_copies(params),
    temperature=temperature,
    tokenizer_path=os.fspath(tok) if tok.is_file() else None,
    image_size=size,
  )


def _own_copies(tree):
  """C-contiguous copies (the transposes above are views), so every leaf owns its bytes."""
  if isinstance(tree, dict):
    return {k: _own_copies(v) for k, v in tree.items()}
  return np.ascontiguousarray(tree) if np.ndim(tree) else np.asarray(tree)
