"""`--format hf_tipsv2`: a Hugging Face `Tipsv2Model` folder, and the strict reader of such folders.

Why: `transformers.Tipsv2Model.from_pretrained(DIR)` is how most people will run a TIPS-style model
(recipes tips, tipsv2, tipsito, distill). What is written, and why each choice (checked by loading the
folders with transformers 5.14 and 5.24; tests/test_interop_hf_tipsv2.py runs the installed one):

  * `model.safetensors` in the hub's key layout: the official TIPS PyTorch names (`vision_encoder.blocks.
    {i}.attn.qkv`, `text_encoder.transformer.resblocks.{i}.attn.in_proj_weight`, ...). transformers renames
    them at load time into its own parameter names, which changed inside 5.x
    (5.14-5.17: `attention.attention.query`, `mlp.weights_in`; 5.18+: `attention.q_proj`, `mlp.gate_proj`),
    so this is the one layout every 5.x release loads.
  * the second CLS token is HF's register token (`register_tokens`, inserted after CLS *without* a
    position embedding, as tipsito adds none to either CLS token); `pos_embed` has a row for CLS, written
    as zeros; layer scale exists there and is written as ones; SwiGLU's hidden size comes from
    `mlp_ratio` with the same rounding as tipsito (tipsito/config/presets.py: swiglu_hidden_dim).
  * `config.json` makes HF compute what tipsito computes: tanh GELU (`gelu_pytorch_tanh`; HF's default is
    exact GELU) and LayerNorm eps 1e-6 in both towers (HF's text default is 1e-5). On the tiny conformance
    model exact GELU moves the official patch outputs by 4.8e-4 and eps 1e-5 the text embeddings by 4e-6.
    The temperature (T of logits = cos / T) is the config
    value `temperature_init_value`: HF initialises its `temperature` parameter from it when the weights
    have none.
  * `preprocessor_config.json` with the model's pixel statistics, training size and tipsito's bicubic
    resize; `tokenizer.model` +
    `tokenizer_config.json` for `Tipsv2Tokenizer` when the model has a SentencePiece tokenizer.

The reader (`read_hf_tipsv2`) is what `config.init_from`, `distill.teacher` and `export --from` use on
such a folder. A downloaded checkpoint is untrusted input: only `config.json`-style JSON and safetensors
are read (never a pickle: no `torch.load`, no remote code). It accepts the hub layout and both native
layouts above, folds a layer scale into the projection before it and a CLS position embedding into the
CLS token (exact for ones and zeros, which is what tipsito writes), and is strict: every tensor is used,
none is missing, every shape is checked.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Mapping, Optional

import numpy as np

from tipsito import export_format
from tipsito import paths
from tipsito import tips_import
from tipsito.interop.tips_npz import NotRepresentableError, _flat, check_tips_style
from tipsito.models import kwargs as kwargs_lib
from tipsito.models import layer_stack
from tipsito.config import presets
from tipsito.models.text import TextEncoder
from tipsito.models.vit import VisionTransformer

WEIGHTS_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
TOKENIZER_FILE = 'tokenizer.model'
MODEL_TYPE = 'tipsv2'
VISION_ACT = 'gelu_pytorch_tanh'  # torch's tanh-approximated GELU = flax nn.gelu (tipsito's vision MLP)
LN_EPS = 1e-6  # tipsito/models/layers.py: LN_EPS
_V, _T = 'vision_encoder.', 'text_encoder.'
# Pickle-based weight files; never opened (named in the error so the user knows why).
_PICKLED = ('pytorch_model.bin', 'pytorch_model.bin.index.json', 'model.pt', 'model.pth', 'model.ckpt')


class CheckpointFormatError(ValueError):
  """A Tipsv2 folder whose config, keys or shapes do not match what is expected."""


def _safetensors_numpy():
  """safetensors' numpy API, or an error saying what to install."""
  try:
    import safetensors.numpy as st  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
      'Hugging Face folders need the `safetensors` package: pip install safetensors '
      '(or pip install -e ".[interop]")'
    ) from e
  return st


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def mlp_ratio_for(width: int, mlp_dim: int) -> float | int:
  """A `mlp_ratio` with int(width * ratio) == mlp_dim, the way HF sizes the vision MLP."""
  if mlp_dim % width == 0:
    return mlp_dim // width
  r = mlp_dim / width
  for _ in range(8):
    if int(width * r) == mlp_dim:
      return r
    r = float(np.nextafter(r, math.inf))
  raise NotRepresentableError(f'no float mlp_ratio gives an MLP of {mlp_dim} for width {width}')


def _grid(image_config: Mapping[str, Any]) -> int:
  """The square position-embedding grid (HF's interpolation assumes a square grid)."""
  g = image_config['posemb_grid']
  if isinstance(g, (list, tuple)):
    if len(g) != 2 or int(g[0]) != int(g[1]):
      raise NotRepresentableError(
        f'--format hf_tipsv2: position-embedding grid {list(g)} is not square; '
        'Tipsv2 interpolates a square grid only'
      )
    g = g[0]
  return int(g)


def hf_config(image_config: Mapping[str, Any], text_config: Mapping[str, Any], temperature: float) -> dict:
  """The `Tipsv2Config` (config.json) under which HF computes what tipsito computes."""
  width = int(image_config['width'])
  patch = int(image_config['patch_size'])
  vision = dict(
    model_type='tipsv2_vision_model',
    hidden_size=width,
    num_hidden_layers=int(image_config['depth']),
    num_attention_heads=int(image_config['num_heads']),
    mlp_ratio=mlp_ratio_for(width, int(image_config['mlp_dim'])),
    hidden_act=VISION_ACT,
    layer_norm_eps=LN_EPS,
    image_size=_grid(image_config) * patch,
    patch_size=patch,
    num_channels=3,
    qkv_bias=True,
    layerscale_value=1.0,
    use_swiglu_ffn=image_config['ffn'] == 'swiglu',
    num_register_tokens=int(image_config['num_cls_tokens']) - 1,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    drop_path_rate=0.0,
  )
  text = dict(
    model_type='tipsv2_text_model',
    vocab_size=int(text_config['vocab_size']),
    hidden_size=int(text_config['width']),
    intermediate_size=int(text_config['mlp_dim']),
    num_hidden_layers=int(text_config['depth']),
    num_attention_heads=int(text_config['num_heads']),
    max_position_embeddings=int(text_config['max_len']),
    hidden_act='relu',
    layer_norm_eps=LN_EPS,
    attention_dropout=0.0,
    pad_token_id=0,
    scale_sqrt_depth=True,
    pooling_epsilon=1e-8,
  )
  return dict(
    architectures=['Tipsv2Model'],
    model_type=MODEL_TYPE,
    dtype='float32',
    temperature_init_value=float(temperature),
    text_config=text,
    vision_config=vision,
  )


def _c(x) -> np.ndarray:
  """Contiguous float32 (safetensors stores row-major buffers)."""
  return np.ascontiguousarray(np.asarray(x, np.float32))


def to_hub_state(
  image_config: Mapping[str, Any], text_config: Mapping[str, Any], params: Mapping[str, Any]
) -> dict[str, np.ndarray]:
  """tipsito {'image', 'text'} params -> {hub key: array} (transposes, reshapes and concatenations only)."""
  img, txt = _flat(params['image']), _flat(params['text'])
  used_img, used_txt = set(), set()

  def take(flat, used, key):
    used.add(key)
    return flat[key]

  d = int(image_config['width'])
  sd: dict[str, np.ndarray] = {}
  gi = lambda k: take(img, used_img, k)  # noqa: E731
  gt = lambda k: take(txt, used_txt, k)  # noqa: E731
  sd[_V + 'patch_embed.proj.weight'] = gi('patch_embed/kernel').transpose(3, 2, 0, 1)
  sd[_V + 'patch_embed.proj.bias'] = gi('patch_embed/bias')
  cls = gi('cls')
  sd[_V + 'cls_token'] = cls[:, :1]
  sd[_V + 'register_tokens'] = cls[:, 1:]
  pos = gi('posemb')
  g = _grid(image_config)
  if pos.shape[1:3] != (g, g):
    raise NotRepresentableError(f'posemb shape {pos.shape} does not match the grid {g}')
  sd[_V + 'pos_embed'] = np.concatenate([np.zeros((1, 1, d), np.float32), pos.reshape(1, g * g, d)], 1)
  sd[_V + 'mask_token'] = np.zeros((1, d), np.float32)  # inference never masks; HF models carry one
  sd[_V + 'norm.weight'], sd[_V + 'norm.bias'] = gi('norm/scale'), gi('norm/bias')

  def attn(get, b, dim):
    qkv_w = [get(f'{b}attn/{n}/kernel').reshape(dim, dim).T for n in ('query', 'key', 'value')]
    qkv_b = [get(f'{b}attn/{n}/bias').reshape(dim) for n in ('query', 'key', 'value')]
    return (
      np.concatenate(qkv_w, 0),
      np.concatenate(qkv_b, 0),
      get(f'{b}attn/out/kernel').reshape(dim, dim).T,
      get(f'{b}attn/out/bias'),
    )

  swiglu = image_config['ffn'] == 'swiglu'
  for i in range(int(image_config['depth'])):
    b, o = f'block_{i}/', f'{_V}blocks.{i}.'
    for n in ('norm1', 'norm2'):
      sd[f'{o}{n}.weight'], sd[f'{o}{n}.bias'] = gi(f'{b}{n}/scale'), gi(f'{b}{n}/bias')
    (
      sd[o + 'attn.qkv.weight'],
      sd[o + 'attn.qkv.bias'],
      sd[o + 'attn.proj.weight'],
      sd[o + 'attn.proj.bias'],
    ) = attn(gi, b, d)
    sd[o + 'ls1.gamma'] = np.ones((d,), np.float32)
    sd[o + 'ls2.gamma'] = np.ones((d,), np.float32)
    if swiglu:
      sd[o + 'mlp.w12.weight'] = np.concatenate(
        [gi(f'{b}mlp/Dense_0/kernel').T, gi(f'{b}mlp/Dense_1/kernel').T], 0
      )
      sd[o + 'mlp.w12.bias'] = np.concatenate([gi(f'{b}mlp/Dense_0/bias'), gi(f'{b}mlp/Dense_1/bias')])
      sd[o + 'mlp.w3.weight'] = gi(f'{b}mlp/Dense_2/kernel').T
      sd[o + 'mlp.w3.bias'] = gi(f'{b}mlp/Dense_2/bias')
    else:
      for j, hub in ((0, 'fc1'), (1, 'fc2')):
        sd[f'{o}mlp.{hub}.weight'] = gi(f'{b}mlp/Dense_{j}/kernel').T
        sd[f'{o}mlp.{hub}.bias'] = gi(f'{b}mlp/Dense_{j}/bias')

  dt = int(text_config['width'])
  sd[_T + 'token_embedding.weight'] = gt('token_emb/embedding')
  sd[_T + 'ln_final.weight'], sd[_T + 'ln_final.bias'] = gt('norm/scale'), gt('norm/bias')
  for i in range(int(text_config['depth'])):
    b, o = f'block_{i}/', f'{_T}transformer.resblocks.{i}.'
    for n, hub in (('norm1', 'ln_1'), ('norm2', 'ln_2')):
      sd[f'{o}{hub}.weight'], sd[f'{o}{hub}.bias'] = gt(f'{b}{n}/scale'), gt(f'{b}{n}/bias')
    (
      sd[o + 'attn.in_proj_weight'],
      sd[o + 'attn.in_proj_bias'],
      sd[o + 'attn.out_proj.weight'],
      sd[o + 'attn.out_proj.bias'],
    ) = attn(gt, b, dt)
    for j, hub in ((0, 'c_fc'), (1, 'c_proj')):
      sd[f'{o}mlp.{hub}.weight'] = gt(f'{b}mlp/Dense_{j}/kernel').T
      sd[f'{o}mlp.{hub}.bias'] = gt(f'{b}mlp/Dense_{j}/bias')

  for what, flat, used in (('image', img, used_img), ('text', txt, used_txt)):
    left = sorted(set(flat) - used)
    if left:
      raise NotRepresentableError(f'--format hf_tipsv2: {what} params {left} have no place in Tipsv2Model')
  return {k: _c(v) for k, v in sd.items()}


def preprocessor_config(image_config: Mapping[str, Any], size: int) -> dict:
  """`Tipsv2ImageProcessor` settings: bicubic resize to `size` (tipsito's eval resize is PIL bicubic,
  tipsito/data/transforms.py: fixed_resize), /255, the model's mean/std (none for TIPS)."""
  mean = [float(x) for x in image_config['pixel_mean']]
  std = [float(x) for x in image_config['pixel_std']]
  return dict(
    image_processor_type='Tipsv2ImageProcessor',
    do_resize=True,
    size={'height': int(size), 'width': int(size)},
    resample=3,
    do_rescale=True,
    rescale_factor=1 / 255,
    do_normalize=(mean != [0.0] * 3 or std != [1.0] * 3),
    image_mean=mean,
    image_std=std,
    do_convert_rgb=True,
  )


def tokenizer_config(max_len: int) -> dict:
  """`Tipsv2Tokenizer` settings matching tipsito's tokenizer: lower-cased, pad 0, no BOS/EOS, right
  padding."""
  return dict(
    tokenizer_class='Tipsv2Tokenizer',
    model_max_length=int(max_len),
    do_lower_case=True,
    pad_token='<pad>',
    unk_token='<unk>',
    bos_token=None,
    eos_token=None,
    padding_side='right',
  )


def write_hf_tipsv2(
  output_dir,
  *,
  image_config: Mapping[str, Any],
  text_config: Mapping[str, Any],
  params: Mapping[str, Any],
  temperature: float,
  tokenizer_path=None,
  image_size: Optional[int] = None,
) -> str:
  """Writes a folder `transformers.Tipsv2Model.from_pretrained(output_dir)` opens offline.

  `image_size` goes to preprocessor_config.json (default: the position-embedding grid x patch, where HF
  does not interpolate). Refuses models Tipsv2 cannot hold (CLIP-style towers, non-square grids).
  """
  from etils import epath  # pylint: disable=g-import-not-at-top

  st = _safetensors_numpy()
  check_tips_style(image_config, text_config, params, 'hf_tipsv2')
  cfg = hf_config(image_config, text_config, temperature)
  state = to_hub_state(image_config, text_config, params)
  out = export_format.as_path(output_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / WEIGHTS_FILE).write_bytes(st.save(state, metadata={'format': 'pt'}))
  (out / 'config.json').write_text(json.dumps(cfg, indent=2, sort_keys=True))
  size = int(image_size) if image_size else cfg['vision_config']['image_size']
  (out / 'preprocessor_config.json').write_text(
    json.dumps(preprocessor_config(image_config, size), indent=2, sort_keys=True)
  )
  if tokenizer_path:
    (out / TOKENIZER_FILE).write_bytes(epath.Path(os.fspath(tokenizer_path)).read_bytes())
    (out / 'tokenizer_config.json').write_text(
      json.dumps(tokenizer_config(int(text_config['max_len'])), indent=2, sort_keys=True)
    )
  return os.fspath(out)


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def is_tipsv2_folder(path) -> bool:
  """A folder whose config.json says model_type 'tipsv2' (weights are checked when read)."""
  if not path:
    return False
  cfg = paths.as_path(path) / 'config.json'
  if not cfg.is_file():
    return False
  try:
    return json.loads(cfg.read_text()).get('model_type') == MODEL_TYPE
  except (ValueError, AttributeError):
    return False


def _read_json(path, what: str) -> dict:
  try:
    out = json.loads(path.read_text())
  except ValueError as e:
    raise CheckpointFormatError(f'{os.fspath(path)}: not valid JSON ({what}): {e}') from None
  if not isinstance(out, dict):
    raise CheckpointFormatError(f'{os.fspath(path)}: expected a JSON object ({what})')
  return out


def read_state(folder) -> dict[str, np.ndarray]:
  """All tensors of a folder's safetensors weights (one file or an index of shards); never a pickle."""
  st = _safetensors_numpy()
  if (folder / WEIGHTS_FILE).is_file():
    files = [WEIGHTS_FILE]
  elif (folder / INDEX_FILE).is_file():
    weight_map = _read_json(folder / INDEX_FILE, 'safetensors index').get('weight_map')
    if not isinstance(weight_map, dict):
      raise CheckpointFormatError(f'{os.fspath(folder / INDEX_FILE)}: no weight_map')
    files = sorted(set(weight_map.values()))
    for f in files:  # shard names are file names inside the folder, nothing else
      if (
        not isinstance(f, str)
        or os.path.basename(f) != f
        or f in ('.', '..')
        or not f.endswith('.safetensors')
      ):
        raise CheckpointFormatError(f'{os.fspath(folder / INDEX_FILE)}: refusing shard name {f!r}')
  else:
    pickled = [p for p in _PICKLED if (folder / p).exists()]
    hint = (
      (
        f' (found {pickled}: pickle-based files are never opened, since loading one can run code; '
        'convert them to safetensors with a tool you trust)'
      )
      if pickled
      else ''
    )
    raise CheckpointFormatError(f'{os.fspath(folder)}: no {WEIGHTS_FILE} or {INDEX_FILE}{hint}')
  state: dict[str, np.ndarray] = {}
  for f in files:
    part = st.load((folder / f).read_bytes())
    dup = set(part) & set(state)
    if dup:
      raise CheckpointFormatError(f'{os.fspath(folder / f)}: tensors {sorted(dup)[:5]} appear twice')
    state.update(part)
  return state


# native 5.18+ / 5.14-5.17 name -> hub name, per tower (applied after the tower prefix is swapped)
_VISION_NATIVE = (
  (r'^embeddings\.patch_embeddings\.projection\.', 'patch_embed.proj.'),
  (r'^embeddings\.(cls_token|mask_token|register_tokens)$', r'\1'),
  (r'^embeddings\.position_embeddings$', 'pos_embed'),
  (r'^layernorm\.', 'norm.'),
  (r'^encoder\.layer\.(\d+)\.', r'blocks.\1.'),
  (r'\.attention\.o_proj\.', '.attn.proj.'),  # 5.18+
  (r'\.attention\.output\.dense\.', '.attn.proj.'),  # 5.14-5.17
  (r'\.layer_scale([12])\.lambda1$', r'.ls\1.gamma'),
  (r'\.mlp\.down_proj\.', '.mlp.w3.'),  # 5.18+
  (r'\.mlp\.weights_out\.', '.mlp.w3.'),  # 5.14-5.17
  (r'\.mlp\.weights_in\.', '.mlp.w12.'),  # 5.14-5.17
)
_VISION_FUSE = (  # (parts that are concatenated on axis 0, in order) -> hub name
  (('.attention.q_proj.', '.attention.k_proj.', '.attention.v_proj.'), '.attn.qkv.'),
  (('.attention.attention.query.', '.attention.attention.key.', '.attention.attention.value.'), '.attn.qkv.'),
  (('.mlp.gate_proj.', '.mlp.up_proj.'), '.mlp.w12.'),
)
_TEXT_NATIVE = (
  (r'^embeddings\.token_embedding\.', 'token_embedding.'),
  (r'^final_layer_norm\.', 'ln_final.'),
  (r'^encoder\.layers\.(\d+)\.', r'transformer.resblocks.\1.'),
  (r'\.layer_norm([12])\.', r'.ln_\1.'),
  (r'\.self_attn\.out_proj\.', '.attn.out_proj.'),
  (r'\.mlp\.fc1\.', '.mlp.c_fc.'),
  (r'\.mlp\.fc2\.', '.mlp.c_proj.'),
)
_TEXT_FUSE = ((('.self_attn.q_proj.', '.self_attn.k_proj.', '.self_attn.v_proj.'), '.attn.in_proj_'),)


def _to_hub_tower(sub: dict[str, np.ndarray], renames, fuses) -> dict[str, np.ndarray]:
  """One tower's native names -> hub names (q/k/v and gate/up concatenated on axis 0, as the hub stores
  them)."""
  sub, fused = dict(sub), {}
  for parts, target in fuses:
    for k in [k for k in sub if parts[0] in k]:
      head, leaf = k.split(parts[0], 1)  # leaf: 'weight' | 'bias'
      names = [head + p + leaf for p in parts]
      missing = [n for n in names if n not in sub]
      if missing:
        raise CheckpointFormatError(f'{k!r} without {missing}')
      fused[head + target + leaf] = np.concatenate([sub.pop(n) for n in names], 0)
  out: dict[str, np.ndarray] = {}
  for k, v in list(sub.items()) + list(fused.items()):
    for pat, rep in renames:
      k = re.sub(pat, rep, k)
    if k in out:
      raise CheckpointFormatError(f'two tensors map to {k!r}')
    out[k] = v
  return out


def to_hub_layout(state: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
  """(state in the hub layout, the layout it came in: 'hub' | 'native') of a Tipsv2Model state dict."""
  keys = list(state)
  if any(k.startswith(_V) or k.startswith(_T) for k in keys):
    return dict(state), 'hub'
  if not any(k.startswith('vision_model.') or k.startswith('text_model.') for k in keys):
    raise CheckpointFormatError(
      'no vision_encoder./text_encoder. (hub) or vision_model./text_model. '
      f'(transformers) tensors; first keys: {sorted(keys)[:5]}'
    )
  out: dict[str, np.ndarray] = {}
  vis = {k[len('vision_model.') :]: v for k, v in state.items() if k.startswith('vision_model.')}
  txt = {k[len('text_model.') :]: v for k, v in state.items() if k.startswith('text_model.')}
  other = {k: v for k, v in state.items() if not k.startswith(('vision_model.', 'text_model.'))}
  out.update({_V + k: v for k, v in _to_hub_tower(vis, _VISION_NATIVE, _VISION_FUSE).items()})
  out.update({_T + k: v for k, v in _to_hub_tower(txt, _TEXT_NATIVE, _TEXT_FUSE).items()})
  out.update(other)
  return out, 'native'


def _f32(a: np.ndarray) -> np.ndarray:
  return np.asarray(a, np.float32)


def _tipsito_configs(
  cfg: Mapping[str, Any], state: Mapping[str, np.ndarray], pre: Mapping[str, Any]
) -> tuple[dict, dict, list[str]]:
  """(image kwargs, text kwargs, notes) from a Tipsv2Config; refuses what tipsito cannot compute."""
  vc, tc = dict(cfg.get('vision_config') or {}), dict(cfg.get('text_config') or {})
  notes = []
  # Tipsv2Config's own defaults for keys a config.json leaves out.
  width = int(vc.get('hidden_size', 768))
  patch = vc.get('patch_size', 14)
  if isinstance(patch, (list, tuple)):
    if len(patch) != 2 or patch[0] != patch[1]:
      raise CheckpointFormatError(f'vision_config.patch_size {patch} is not square')
    patch = patch[0]
  act = vc.get('hidden_act', 'gelu')
  if act in ('gelu',):
    notes.append(
      "vision_config.hidden_act is 'gelu' (exact); tipsito computes the official tanh GELU "
      '(outputs differ by about 5e-4 from what this config makes transformers compute)'
    )
  elif act not in ('gelu_pytorch_tanh', 'gelu_new', 'gelu_fast'):
    raise CheckpointFormatError(f'vision_config.hidden_act {act!r}: tipsito computes GELU only')
  if tc.get('hidden_act', 'relu') != 'relu':
    raise CheckpointFormatError(
      f"text_config.hidden_act {tc.get('hidden_act')!r}: the TIPS text tower is ReLU"
    )
  for what, c, default in (('vision', vc, 1e-6), ('text', tc, 1e-5)):
    eps = float(c.get('layer_norm_eps', default))
    if eps != LN_EPS:
      notes.append(f'{what}_config.layer_norm_eps is {eps}; tipsito computes LayerNorm with eps {LN_EPS}')
  if not vc.get('qkv_bias', True):
    raise CheckpointFormatError('vision_config.qkv_bias is False; tipsito attention has q/k/v biases')
  if not tc.get('scale_sqrt_depth', True):
    raise CheckpointFormatError(
      'text_config.scale_sqrt_depth is False; the TIPS text tower scales by sqrt(D)'
    )
  if int(vc.get('num_channels', 3)) != 3:
    raise CheckpointFormatError(f"vision_config.num_channels {vc.get('num_channels')}: RGB only")
  pos = state.get(_V + 'pos_embed')
  if pos is None or pos.ndim != 3:
    raise CheckpointFormatError(f"missing or misshapen {_V}pos_embed: {None if pos is None else pos.shape}")
  grid = math.isqrt(pos.shape[1] - 1)
  if grid * grid != pos.shape[1] - 1:
    raise CheckpointFormatError(f'{_V}pos_embed has {pos.shape[1] - 1} patch rows, not a square grid')
  ratio = vc.get('mlp_ratio', 4)
  mlp_dim = int(width * ratio)
  swiglu = bool(vc.get('use_swiglu_ffn', False))  # SwiGLU hidden size: the same rounding of mlp_dim
  mean, std = [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]
  if pre.get('do_normalize', False):
    mean = [float(x) for x in pre.get('image_mean', mean)]
    std = [float(x) for x in pre.get('image_std', std)]
  if pre and not pre.get('do_rescale', True):
    notes.append('preprocessor_config.json has do_rescale False; tipsito feeds pixels in [0, 1]')
  image = dict(
    patch_size=int(patch),
    width=width,
    depth=int(vc.get('num_hidden_layers', 12)),
    num_heads=int(vc.get('num_attention_heads', 12)),
    mlp_dim=mlp_dim,
    ffn='swiglu' if swiglu else 'mlp',
    num_cls_tokens=1 + int(vc.get('num_register_tokens', 1)),
    posemb_grid=grid,
    pixel_mean=mean,
    pixel_std=std,
  )
  text = dict(
    flavour='tips',
    vocab_size=int(tc.get('vocab_size', 32000)),
    max_len=int(tc.get('max_position_embeddings', 64)),
    width=int(tc.get('hidden_size', 768)),
    depth=int(tc.get('num_hidden_layers', 12)),
    num_heads=int(tc.get('num_attention_heads', 12)),
    mlp_dim=int(tc.get('intermediate_size', 3072)),
    out_dim=None,
  )
  return image, text, notes


class _Taker:
  """Pops hub tensors by name, so that the ones never asked for are reported (strict reading)."""

  def __init__(self, state: Mapping[str, np.ndarray]):
    self.state = dict(state)

  def __call__(self, key: str, shape: Optional[tuple] = None) -> np.ndarray:
    if key not in self.state:
      raise CheckpointFormatError(f'missing tensor {key!r}' + (f' (expected shape {shape})' if shape else ''))
    arr = self.state.pop(key)
    if shape is not None and tuple(arr.shape) != tuple(shape):
      raise CheckpointFormatError(f'tensor {key!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}')
    return _f32(arr)


def _from_hub(take: _Taker, icfg: Mapping[str, Any], tcfg: Mapping[str, Any]) -> dict:
  """Hub tensors -> tipsito {'image', 'text'} params (the inverse of `to_hub_state`, layer scale folded)."""
  from flax import traverse_util  # pylint: disable=g-import-not-at-top

  d, p, g = icfg['width'], icfg['patch_size'], icfg['posemb_grid']
  heads, nreg = icfg['num_heads'], icfg['num_cls_tokens'] - 1
  img: dict[str, np.ndarray] = {}
  img['patch_embed/kernel'] = take(_V + 'patch_embed.proj.weight', (d, 3, p, p)).transpose(2, 3, 1, 0)
  img['patch_embed/bias'] = take(_V + 'patch_embed.proj.bias', (d,))
  pos = take(_V + 'pos_embed', (1, 1 + g * g, d))
  cls = take(_V + 'cls_token', (1, 1, d)) + pos[:, :1]  # HF adds pos row 0 to CLS: fold it (zeros: exact)
  img['cls'] = np.concatenate([cls, take(_V + 'register_tokens', (1, nreg, d))], 1)
  img['posemb'] = np.ascontiguousarray(pos[:, 1:].reshape(1, g, g, d))
  if _V + 'mask_token' in take.state:
    take(_V + 'mask_token')  # training-only (tipsito initialises its own when a recipe masks)
  img['norm/scale'], img['norm/bias'] = take(_V + 'norm.weight', (d,)), take(_V + 'norm.bias', (d,))

  def attn(out, b, o, qkv, proj, dim, nh, gamma):
    w, bias = take(f'{o}{qkv}weight', (3 * dim, dim)), take(f'{o}{qkv}bias', (3 * dim,))
    for j, n in enumerate(('query', 'key', 'value')):
      rows = slice(j * dim, (j + 1) * dim)
      out[f'{b}attn/{n}/kernel'] = np.ascontiguousarray(w[rows].T.reshape(dim, nh, dim // nh))
      out[f'{b}attn/{n}/bias'] = bias[rows].reshape(nh, dim // nh)
    pw, pb = take(f'{o}{proj}weight', (dim, dim)), take(f'{o}{proj}bias', (dim,))
    out[f'{b}attn/out/kernel'] = np.ascontiguousarray((pw * gamma[:, None]).T.reshape(nh, dim // nh, dim))
    out[f'{b}attn/out/bias'] = pb * gamma

  mlp = icfg['mlp_dim']
  hidden = presets.swiglu_hidden_dim(mlp)
  for i in range(icfg['depth']):
    b, o = f'block_{i}/', f'{_V}blocks.{i}.'
    for n in ('norm1', 'norm2'):
      img[f'{b}{n}/scale'], img[f'{b}{n}/bias'] = take(f'{o}{n}.weight', (d,)), take(f'{o}{n}.bias', (d,))
    ls1 = take(f'{o}ls1.gamma', (d,)) if f'{o}ls1.gamma' in take.state else np.ones((d,), np.float32)
    ls2 = take(f'{o}ls2.gamma', (d,)) if f'{o}ls2.gamma' in take.state else np.ones((d,), np.float32)
    attn(img, b, o, 'attn.qkv.', 'attn.proj.', d, heads, ls1)
    if icfg['ffn'] == 'swiglu':
      w12, b12 = take(f'{o}mlp.w12.weight', (2 * hidden, d)), take(f'{o}mlp.w12.bias', (2 * hidden,))
      for j, half in ((0, slice(None, hidden)), (1, slice(hidden, None))):  # gate, then up
        img[f'{b}mlp/Dense_{j}/kernel'] = np.ascontiguousarray(w12[half].T)
        img[f'{b}mlp/Dense_{j}/bias'] = b12[half]
      w3, b3 = take(f'{o}mlp.w3.weight', (d, hidden)), take(f'{o}mlp.w3.bias', (d,))
      img[f'{b}mlp/Dense_2/kernel'] = np.ascontiguousarray((w3 * ls2[:, None]).T)
      img[f'{b}mlp/Dense_2/bias'] = b3 * ls2
    else:
      img[f'{b}mlp/Dense_0/kernel'] = np.ascontiguousarray(take(f'{o}mlp.fc1.weight', (mlp, d)).T)
      img[f'{b}mlp/Dense_0/bias'] = take(f'{o}mlp.fc1.bias', (mlp,))
      w2, b2 = take(f'{o}mlp.fc2.weight', (d, mlp)), take(f'{o}mlp.fc2.bias', (d,))
      img[f'{b}mlp/Dense_1/kernel'] = np.ascontiguousarray((w2 * ls2[:, None]).T)
      img[f'{b}mlp/Dense_1/bias'] = b2 * ls2

  dt, th, tm = tcfg['width'], tcfg['num_heads'], tcfg['mlp_dim']
  txt: dict[str, np.ndarray] = {}
  txt['token_emb/embedding'] = take(_T + 'token_embedding.weight', (tcfg['vocab_size'], dt))
  txt['norm/scale'], txt['norm/bias'] = take(_T + 'ln_final.weight', (dt,)), take(_T + 'ln_final.bias', (dt,))
  one = np.ones((dt,), np.float32)
  for i in range(tcfg['depth']):
    b, o = f'block_{i}/', f'{_T}transformer.resblocks.{i}.'
    for n, hub in (('norm1', 'ln_1'), ('norm2', 'ln_2')):
      txt[f'{b}{n}/scale'] = take(f'{o}{hub}.weight', (dt,))
      txt[f'{b}{n}/bias'] = take(f'{o}{hub}.bias', (dt,))
    attn(txt, b, o, 'attn.in_proj_', 'attn.out_proj.', dt, th, one)
    txt[f'{b}mlp/Dense_0/kernel'] = np.ascontiguousarray(take(f'{o}mlp.c_fc.weight', (tm, dt)).T)
    txt[f'{b}mlp/Dense_0/bias'] = take(f'{o}mlp.c_fc.bias', (tm,))
    txt[f'{b}mlp/Dense_1/kernel'] = np.ascontiguousarray(take(f'{o}mlp.c_proj.weight', (dt, tm)).T)
    txt[f'{b}mlp/Dense_1/bias'] = take(f'{o}mlp.c_proj.bias', (dt,))
  return {
    'image': traverse_util.unflatten_dict(img, sep='/'),
    'text': traverse_util.unflatten_dict(txt, sep='/'),
  }


def _check_against_modules(
  icfg: Mapping[str, Any], tcfg: Mapping[str, Any], params: Mapping[str, Any]
) -> None:
  """Every param of the tipsito towers is filled, with its shape (the importer's strictness)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import traverse_util  # pylint: disable=g-import-not-at-top

  p = icfg['patch_size']
  for what, module, dummy, tree in (
    ('image', VisionTransformer(**icfg), jnp.zeros((1, p, p, 3), jnp.float32), params['image']),
    ('text', TextEncoder(**tcfg), jnp.zeros((1, 4), jnp.int32), params['text']),
  ):
    expected = tips_import._expected_flat(module, dummy)  # pylint: disable=protected-access
    got = {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(tree, sep='/').items()}
    if expected != got:
      diff = sorted(set(expected.items()) ^ set(got.items()))[:6]
      raise CheckpointFormatError(f'{what} params do not fit the tipsito tower of this config: {diff}')


def read_hf_tipsv2(path) -> dict[str, Any]:
  """Reads a local Tipsv2Model folder into tipsito's terms.

  Returns {'image_config', 'text_config', 'params' ({'image', 'text'}, numpy), 'temperature',
  'tokenizer_path' (or None), 'image_size' (preprocessor size or None), 'layout', 'notes'}.
  """
  folder = paths.as_path(path)
  if not (folder / 'config.json').is_file():
    raise CheckpointFormatError(f'{os.fspath(folder)}: no config.json (not a Hugging Face model folder)')
  cfg = _read_json(folder / 'config.json', 'model config')
  if cfg.get('model_type') != MODEL_TYPE:
    raise CheckpointFormatError(
      f"{os.fspath(folder)}: config.json model_type {cfg.get('model_type')!r}, "
      f'expected {MODEL_TYPE!r} (a Tipsv2Model folder)'
    )
  pre = (
    _read_json(folder / 'preprocessor_config.json', 'image processor')
    if (folder / 'preprocessor_config.json').is_file()
    else {}
  )
  state, layout = to_hub_layout(read_state(folder))
  icfg, tcfg, notes = _tipsito_configs(cfg, state, pre)
  if icfg['width'] != tcfg['width']:
    raise CheckpointFormatError(f"vision width {icfg['width']} != text width {tcfg['width']}")
  temperature = float(cfg.get('temperature_init_value', 0.005065968260169029))
  take = _Taker(state)
  if 'temperature' in take.state:  # a model saved by transformers carries its (learnable) temperature
    temperature = float(take('temperature', ()))
  params = _from_hub(take, icfg, tcfg)
  if take.state:
    raise CheckpointFormatError(
      f'{os.fspath(folder)}: unexpected tensors (not used by the architecture of '
      f'config.json): {sorted(take.state)[:8]}'
    )
  _check_against_modules(icfg, tcfg, params)
  # Every key of the tower modules, as an export's config states them (tipsito/models/kwargs.py).
  icfg, _ = kwargs_lib.complete_tower_config(icfg, 'image', os.fspath(folder))
  tcfg, _ = kwargs_lib.complete_tower_config(tcfg, 'text', os.fspath(folder))
  size = pre.get('size') or {}
  image_size = size.get('height') if isinstance(size, dict) else None
  tok = folder / TOKENIZER_FILE
  return dict(
    image_config=icfg,
    text_config=tcfg,
    params=params,
    temperature=temperature,
    tokenizer_path=os.fspath(tok) if tok.is_file() else None,
    image_size=int(image_size) if image_size else None,
    layout=layout,
    notes=notes,
  )


# --------------------------------------------------------------------------------------------------
# Training from a Tipsv2 folder (config.init_from, distill.teacher)
# --------------------------------------------------------------------------------------------------


def init_train_params(path, init_params: Mapping[str, Any], abstract_params: Mapping[str, Any]) -> dict:
  """Training params with the image and text towers (and the temperature, as `logit_scale` = ln(1/T))
  taken from a Tipsv2 folder; every other part (heads, mask token, fusion, ...) keeps `init_params`.

  The towers must have the run's shapes (checked per leaf, errors name the leaf); scanned towers get the
  folder's per-layer weights stacked (tipsito/models/layer_stack.py). Arrays are placed with the
  shardings of `abstract_params`, every process building only its own shards.
  """
  from flax import traverse_util  # pylint: disable=g-import-not-at-top

  r = read_hf_tipsv2(path)
  scan = {k: layer_stack.is_stacked(abstract_params[k]) for k in ('image', 'text') if k in abstract_params}
  loaded = layer_stack.to_layout(r['params'], scan)
  out = dict(init_params)
  for tower in ('image', 'text'):
    if tower not in abstract_params:
      continue
    want = traverse_util.flatten_dict(dict(abstract_params[tower]), sep='/')
    got = traverse_util.flatten_dict(dict(loaded[tower]), sep='/')
    keep = traverse_util.flatten_dict(dict(init_params[tower]), sep='/')
    new = {}
    for key, aval in want.items():
      if key not in got:
        if key == 'mask_token':  # training-only, not in inference weights: the run's own init
          new[key] = keep[key]
          continue
        raise CheckpointFormatError(
          f'config.init_from={os.fspath(path)!r}: {tower}/{key} is not in the '
          'Tipsv2 folder (the run has another architecture)'
        )
      arr = got[key]
      if tuple(arr.shape) != tuple(aval.shape):
        raise CheckpointFormatError(
          f'config.init_from={os.fspath(path)!r}: {tower}/{key} has shape '
          f'{tuple(arr.shape)} in the folder, {tuple(aval.shape)} in this run'
        )
      new[key] = _place(arr.astype(aval.dtype), aval.sharding)
    extra = sorted(set(got) - set(want))
    if extra:
      raise CheckpointFormatError(
        f'config.init_from={os.fspath(path)!r}: {tower} tensors {extra[:5]} have '
        'no place in this run (another architecture)'
      )
    out[tower] = traverse_util.unflatten_dict(new, sep='/')
  if 'logit_scale' in abstract_params:
    aval = abstract_params['logit_scale']
    scale = np.full(aval.shape, np.log(1.0 / r['temperature']), aval.dtype)
    out['logit_scale'] = _place(scale, aval.sharding)
  return out


def _place(arr: np.ndarray, sharding):
  """A global jax.Array of host array `arr` with `sharding` (each process fills its addressable shards)."""
  import jax  # pylint: disable=g-import-not-at-top

  if sharding is None:
    return jax.device_put(arr)
  return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])
