"""DPT decoders on a frozen image tower: depth over bins, surface normals, semantic segmentation.

Why this architecture: the TIPSv2 release evaluates and ships its dense heads as DPT decoders (Ranftl et
al. 2021) on the frozen backbone, in the shape transformers' `tipsv2_dpt` models compute them
(`Tipsv2DptForDepthEstimation`, `...ForNormalEstimation`, `...ForSemanticSegmentation`,
`...ForDensePrediction`). Computing the same function here lets a head trained in tipsito run in
transformers and a released head run in tipsito (tipsito/interop/hf_dpt.py; the parity tests are
tests/test_dense_dpt.py). The computation, for an image of gh x gw patches:

1. Inputs: the token sequences after `layers` blocks of the tower (Hugging Face stage numbers: k = after
   block k), each after the tower's final LayerNorm (`VisionTransformer(..., return_blocks=layers)`).
2. Readout (one per input): each patch token is concatenated with the first CLS token and projected back
   to the tower width, z = act(W [patch, cls] + b) (the DPT "project" readout; further CLS tokens, the
   Hugging Face register tokens, are not read). act is tanh GELU by default.
3. Reassemble: a 1x1 conv to `neck_hidden_sizes[i]` channels, then a resize by `reassemble_factors[i]`:
   factor f > 1 is a transposed conv with kernel = stride = f (each token becomes an f x f tile), 1 is
   nothing, 0.5 is a 3x3 conv of stride 2 and padding 1 (ceil(g / 2) rows). Then a 3x3 conv without bias
   to `fusion_hidden_size` channels.
4. Fusion, from the coarsest map up: h = RCU2(h + RCU1(r)) (the first stage has no r), upsampled 2x
   bilinearly with aligned corners, then a 1x1 conv; RCU(x) = x + conv(relu(conv(relu(x)))) (3x3,
   no bias). A map r whose size differs from h is first resized to it (bilinear, half-pixel centres).
   The output has 8 x the 1x-map's resolution: (8 gh, 8 gw), i.e. 8/patch of the input's size.
5. Decoder: a 3x3 conv (bias) + activation (ReLU for depth, none otherwise) + a per-pixel linear layer to
   the task's channels: `num_depth_bins` (depth), 3 (normals: unnormalised xyz), `num_labels` (seg).
6. Depth from bins: p = (relu(logits) + min_depth) / sum(...), depth = sum_k p_k c_k with c = linspace(
   min_depth, max_depth, num_depth_bins) (dinov2's "linear" bin normalisation, uniform bins; the release's
   256 bins over 0.001-10 m).

Arrays are NHWC (Flax); the param tree mirrors the module names of the Hugging Face decoder one to one
(`readout_{i}`, `reassemble_{i}/{projection,resize}`, `conv_{i}`, `fusion_{i}/{residual1,residual2,
projection}`, `decoder/{project,head}`), so the conversion only transposes kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

TASKS = ('depth', 'normals', 'segmentation')
# transformers' ACT2FN names this decoder's config can hold -> the JAX function.
ACTIVATIONS = {
  'gelu_pytorch_tanh': lambda x: nn.gelu(x, approximate=True),
  'gelu_new': lambda x: nn.gelu(x, approximate=True),
  'gelu': lambda x: nn.gelu(x, approximate=False),
  'relu': nn.relu,
  'identity': lambda x: x,
}


@dataclasses.dataclass(frozen=True)
class DPTConfig:
  """The decoder's shape; field names and defaults are those of transformers' `Tipsv2DptConfig`.

  layers: the tower stages read (HF `backbone_config.out_indices`; None = four evenly spaced, ending at the
  last block). num_labels: segmentation classes. The defaults are the release's (a B/14 tower); a tiny
  tower wants smaller `neck_hidden_sizes` / `fusion_hidden_size` (docs/dense-heads.md).
  """

  layers: Optional[tuple[int, ...]] = None
  neck_hidden_sizes: tuple[int, ...] = (96, 192, 384, 768)
  fusion_hidden_size: int = 256
  reassemble_factors: tuple[float, ...] = (4, 2, 1, 0.5)
  readout_activation: str = 'gelu_pytorch_tanh'
  num_depth_bins: int = 256
  min_depth: float = 0.001
  max_depth: float = 10.0
  depth_decoder_activation: str = 'relu'
  num_labels: int = 150
  semantic_loss_ignore_index: int = 255

  def __post_init__(self):
    n = len(self.neck_hidden_sizes)
    if len(self.reassemble_factors) != n:
      raise ValueError(f'DPT: {n} neck_hidden_sizes but {len(self.reassemble_factors)} reassemble_factors')
    if self.layers is not None and len(self.layers) != n:
      raise ValueError(f'DPT: {n} neck_hidden_sizes but {len(self.layers)} layers {list(self.layers)}')
    for f in self.reassemble_factors:
      if not (f == 1 or (f > 1 and float(f).is_integer()) or (0 < f < 1 and float(1 / f).is_integer())):
        raise ValueError(f'DPT: reassemble factor {f} is not an integer or 1/integer')
    for a in (self.readout_activation, self.depth_decoder_activation):
      if a not in ACTIVATIONS:
        raise ValueError(f'DPT: activation {a!r} not one of {sorted(ACTIVATIONS)}')
    if not 0 < self.min_depth < self.max_depth:
      raise ValueError(f'DPT: need 0 < min_depth < max_depth, got {self.min_depth}, {self.max_depth}')

  def stages(self, depth: int) -> tuple[int, ...]:
    """The tower stages read for a tower of `depth` blocks (`layers`, or evenly spaced: 3,6,9,12 at 12)."""
    n = len(self.neck_hidden_sizes)
    stages = self.layers or tuple(round(depth * (i + 1) / n) for i in range(n))
    if min(stages) < 0 or max(stages) > depth:
      raise ValueError(f'DPT layers {list(stages)}: the tower has stages 0..{depth}')
    if len(set(stages)) != len(stages):
      # transformers' backbones refuse repeated out_indices, so such a head could not be exported.
      raise ValueError(
        f'DPT layers {list(stages)} repeat a stage (a tower of {depth} blocks has {depth + 1} stages): '
        'pass distinct --layers and as many --neck_hidden_sizes and --reassemble_factors'
      )
    return tuple(int(s) for s in stages)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> 'DPTConfig':
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f'DPT config: unknown keys {unknown} (known: {sorted(known)})')
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return cls(**kw)


def out_channels(cfg: DPTConfig, task: str) -> int:
  """The decoder's output channels for a task."""
  if task not in TASKS:
    raise ValueError(f'DPT task {task!r} not one of {TASKS}')
  return {'depth': cfg.num_depth_bins, 'normals': 3, 'segmentation': cfg.num_labels}[task]


def bin_centres(cfg: DPTConfig) -> np.ndarray:
  """The depth bins' centres in metres: linspace(min_depth, max_depth, num_depth_bins) (float32)."""
  return np.linspace(cfg.min_depth, cfg.max_depth, cfg.num_depth_bins, dtype=np.float64).astype(np.float32)


def bins_to_depth(logits: jax.Array, cfg: DPTConfig) -> jax.Array:
  """(..., K) bin logits -> (...) depth: sum_k c_k (relu(z_k) + m) / sum_j (relu(z_j) + m), m = min_depth."""
  p = nn.relu(logits) + cfg.min_depth
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  return p @ jnp.asarray(bin_centres(cfg), logits.dtype)


def interp_matrix(n_in: int, n_out: int, align_corners: bool) -> np.ndarray:
  """(n_out, n_in) weights of 1-D bilinear resampling, as torch's `interpolate(mode='bilinear')` samples.

  align_corners: source x = i (n_in - 1) / (n_out - 1); else half-pixel centres x = (i + 0.5) n_in / n_out
  - 0.5, clamped at 0 (torch clamps negative sources; no antialiasing in either case).
  """
  i = np.arange(n_out, dtype=np.float64)
  if align_corners:
    x = i * (n_in - 1) / (n_out - 1) if n_out > 1 else np.zeros_like(i)
  else:
    x = np.maximum((i + 0.5) * n_in / n_out - 0.5, 0.0)
  x0 = np.minimum(np.floor(x).astype(np.int64), n_in - 1)
  x1 = np.minimum(x0 + 1, n_in - 1)
  f = x - x0
  m = np.zeros((n_out, n_in), np.float64)
  np.add.at(m, (np.arange(n_out), x0), 1 - f)
  np.add.at(m, (np.arange(n_out), x1), f)
  return m.astype(np.float32)


def resize(x: jax.Array, hw: tuple[int, int], align_corners: bool) -> jax.Array:
  """(B, h, w, C) -> (B, H, W, C) bilinear, separably (two small matrix products)."""
  mh = jnp.asarray(interp_matrix(x.shape[1], hw[0], align_corners), x.dtype)
  mw = jnp.asarray(interp_matrix(x.shape[2], hw[1], align_corners), x.dtype)
  return jnp.einsum('Hh,bhwc,Ww->bHWc', mh, x, mw)


class TileUpsample(nn.Module):
  """A transposed conv whose kernel equals its stride f: every input pixel becomes an f x f output tile,
  y[f i + a, f j + b] = W[a, b]^T x[i, j] + bias. Written out (not nn.ConvTranspose) because the tile
  order is then unambiguous: kernel (f, f, in, out) = torch's (in, out, f, f) weight transposed."""

  features: int
  factor: int

  @nn.compact
  def __call__(self, x):
    f = self.factor
    k = self.param('kernel', nn.initializers.lecun_normal(), (f, f, x.shape[-1], self.features))
    b = self.param('bias', nn.initializers.zeros, (self.features,))
    y = jnp.einsum('bhwi,acio->bhawco', x, k.astype(x.dtype))
    bsz, h, _, w, _, c = y.shape
    return y.reshape(bsz, h * f, w * f, c) + b.astype(x.dtype)


def _conv(features, k, name, bias=True, stride=1):
  pad = (k - 1) // 2
  return nn.Conv(
    features, (k, k), strides=(stride, stride), padding=((pad, pad), (pad, pad)), use_bias=bias, name=name
  )


class ResidualUnit(nn.Module):
  """Pre-activation residual conv unit: x + conv2(relu(conv1(relu(x)))), 3x3 convs without bias."""

  @nn.compact
  def __call__(self, x):
    c = x.shape[-1]
    y = _conv(c, 3, 'conv1', bias=False)(nn.relu(x))
    y = _conv(c, 3, 'conv2', bias=False)(nn.relu(y))
    return x + y


class FusionStage(nn.Module):
  """h = RCU2(h + RCU1(r)) (or RCU2(h) without r), upsampled 2x with aligned corners, then a 1x1 conv."""

  has_residual: bool

  @nn.compact
  def __call__(self, h, r=None):
    if r is not None:
      if r.shape != h.shape:
        r = resize(r, h.shape[1:3], align_corners=False)
      h = h + ResidualUnit(name='residual1')(r)
    h = ResidualUnit(name='residual2')(h)
    h = resize(h, (2 * h.shape[1], 2 * h.shape[2]), align_corners=True)
    return _conv(h.shape[-1], 1, 'projection')(h)


class DPTHead(nn.Module):
  """One DPT neck and decoder for one task: tower blocks -> (B, 8 gh, 8 gw, out_channels(task)).

  Call with `blocks`, a sequence of {'cls': (B, n, D), 'patches': (B, gh, gw, D)} (the tower's
  `return_blocks` output, in `cfg.stages` order). Returns the raw decoder output (bin logits for depth,
  unnormalised normals, class logits); `bins_to_depth` turns depth logits into metres.
  """

  cfg: DPTConfig
  task: str

  @nn.compact
  def __call__(self, blocks: Sequence[Mapping[str, jax.Array]]):
    cfg = self.cfg
    if len(blocks) != len(cfg.neck_hidden_sizes):
      raise ValueError(f'DPT: {len(blocks)} tower blocks given, the neck reads {len(cfg.neck_hidden_sizes)}')
    act = ACTIVATIONS[cfg.readout_activation]
    maps = []
    for i, (blk, ch, f) in enumerate(zip(blocks, cfg.neck_hidden_sizes, cfg.reassemble_factors)):
      p, cls = blk['patches'], blk['cls'][:, 0]
      d = p.shape[-1]
      readout = jnp.broadcast_to(cls[:, None, None, :], p.shape)
      x = act(nn.Dense(d, name=f'readout_{i}')(jnp.concatenate([p, readout], -1)))
      x = _conv(ch, 1, f'reassemble_{i}_projection')(x)
      if f > 1:
        x = TileUpsample(ch, int(f), name=f'reassemble_{i}_resize')(x)
      elif f < 1:
        x = _conv(ch, 3, f'reassemble_{i}_resize', stride=int(round(1 / f)))(x)
      maps.append(_conv(cfg.fusion_hidden_size, 3, f'conv_{i}', bias=False)(x))
    h = None
    for j, m in enumerate(maps[::-1]):
      h = FusionStage(has_residual=j > 0, name=f'fusion_{j}')(m if h is None else h, None if h is None else m)
    h = _conv(cfg.fusion_hidden_size, 3, 'decoder_project')(h)
    if self.task == 'depth':
      h = ACTIVATIONS[cfg.depth_decoder_activation](h)
    return nn.Dense(out_channels(cfg, self.task), name='decoder_head')(h)


def init_head(cfg: DPTConfig, task: str, blocks, seed: int = 0):
  """Fresh params of a `DPTHead` for blocks shaped like `blocks` (arrays or ShapeDtypeStructs)."""
  return DPTHead(cfg, task).init(jax.random.PRNGKey(seed), blocks)['params']


def predict(cfg: DPTConfig, task: str, params, blocks) -> jax.Array:
  """The head's prediction: depth in metres (B, H, W), normals (B, H, W, 3) raw, logits (B, H, W, C)."""
  out = DPTHead(cfg, task).apply({'params': params}, blocks)
  return bins_to_depth(out, cfg) if task == 'depth' else out
