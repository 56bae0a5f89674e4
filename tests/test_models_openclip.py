"""The CLIP/SigLIP/ITO towers are OpenCLIP's: a one-to-one parameter mapping and OpenCLIP's forward.

Why: ITO builds on OpenCLIP ViT-B/16, and an exporter to OpenCLIP and Hugging Face `CLIPModel` (a later
issue) must be a renaming plus fixed layout changes, with no parameter left over or missing. This file
holds that mapping (`IMAGE_MAP`, `TEXT_MAP`, `BLOCK_MAP`, `TOP_MAP`: tipsito path -> OpenCLIP
`state_dict` name -> Hugging Face `CLIPModel` `state_dict` name -> layout) and a pure-numpy float64
forward written from OpenCLIP's equations (OpenCLIP `VisionTransformer.forward`, `CLIP.encode_text`,
`text_global_pool(..., 'argmax')`; Hugging Face `CLIPVisionTransformer` / `CLIPTextTransformer`), fed
only the mapped state dicts. It must equal the Flax towers (tipsito/models/vit.py, text.py) built with
tipsito/config/presets.py's 'openclip' structure, as the CLIP-style recipes do
(tipsito/config/defaults.py). The TIPS towers are covered by tests/test_models_conformance.py.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from tipsito.data import tokenizer as tok_lib
from tipsito.config import presets
from tipsito.models import TextEncoder, VisionTransformer, text_config, vit_config
from tipsito.models import vit as vit_lib

# ------------------------------------------------------------------------------------------------
# The mapping. Layouts (tipsito array -> torch array):
#   same   identical array
#   T      2-D kernel (in, out) -> nn.Linear weight (out, in)
#   conv   patch kernel (p, p, 3, D) -> Conv2d weight (D, 3, p, p)
#   vec    class token (1, 1, D) -> (D,)
#   q|k|v  attention kernel (D, H, D/H) -> (D, D) weight; bias (H, D/H) -> (D,). Hugging Face keeps
#          q_proj / k_proj / v_proj; OpenCLIP fuses them: in_proj_weight (3D, D) and in_proj_bias (3D,)
#          are [q; k; v] stacked on the first axis, so the OpenCLIP name carries the chunk
#   out    attention output kernel (H, D/H, D) -> out_proj.weight (D, D)
# The projections are `x @ proj` in OpenCLIP (same layout as tipsito's kernels) and bias-free
# nn.Linear in Hugging Face (T). logit_scale is log(1 / export temperature) in all three.
# ------------------------------------------------------------------------------------------------
TOP_MAP = [  # (tipsito, OpenCLIP, Hugging Face, layout)
  ('image_proj/kernel', 'visual.proj', 'visual_projection.weight', 'same|T'),
  ('text/proj/kernel', 'text_projection', 'text_projection.weight', 'same|T'),
]
IMAGE_MAP = [
  (
    'image/patch_embed/kernel',
    'visual.conv1.weight',
    'vision_model.embeddings.patch_embedding.weight',
    'conv',
  ),
  ('image/cls', 'visual.class_embedding', 'vision_model.embeddings.class_embedding', 'vec'),
  (
    'image/posemb',
    'visual.positional_embedding',
    'vision_model.embeddings.position_embedding.weight',
    'same',
  ),
  ('image/norm_pre/scale', 'visual.ln_pre.weight', 'vision_model.pre_layrnorm.weight', 'same'),
  ('image/norm_pre/bias', 'visual.ln_pre.bias', 'vision_model.pre_layrnorm.bias', 'same'),
  ('image/norm/scale', 'visual.ln_post.weight', 'vision_model.post_layernorm.weight', 'same'),
  ('image/norm/bias', 'visual.ln_post.bias', 'vision_model.post_layernorm.bias', 'same'),
]
TEXT_MAP = [
  (
    'text/token_emb/embedding',
    'token_embedding.weight',
    'text_model.embeddings.token_embedding.weight',
    'same',
  ),
  ('text/posemb', 'positional_embedding', 'text_model.embeddings.position_embedding.weight', 'same'),
  ('text/norm/scale', 'ln_final.weight', 'text_model.final_layer_norm.weight', 'same'),
  ('text/norm/bias', 'ln_final.bias', 'text_model.final_layer_norm.bias', 'same'),
]
BLOCK_PREFIX = {  # tower -> (tipsito block, OpenCLIP block, Hugging Face block)
  'image': ('image/block_{i}/', 'visual.transformer.resblocks.{i}.', 'vision_model.encoder.layers.{i}.'),
  'text': ('text/block_{i}/', 'transformer.resblocks.{i}.', 'text_model.encoder.layers.{i}.'),
}
BLOCK_MAP = [
  ('norm1/scale', 'ln_1.weight', 'layer_norm1.weight', 'same'),
  ('norm1/bias', 'ln_1.bias', 'layer_norm1.bias', 'same'),
  ('attn/query/kernel', 'attn.in_proj_weight', 'self_attn.q_proj.weight', 'q'),
  ('attn/key/kernel', 'attn.in_proj_weight', 'self_attn.k_proj.weight', 'k'),
  ('attn/value/kernel', 'attn.in_proj_weight', 'self_attn.v_proj.weight', 'v'),
  ('attn/query/bias', 'attn.in_proj_bias', 'self_attn.q_proj.bias', 'q'),
  ('attn/key/bias', 'attn.in_proj_bias', 'self_attn.k_proj.bias', 'k'),
  ('attn/value/bias', 'attn.in_proj_bias', 'self_attn.v_proj.bias', 'v'),
  ('attn/out/kernel', 'attn.out_proj.weight', 'self_attn.out_proj.weight', 'out'),
  ('attn/out/bias', 'attn.out_proj.bias', 'self_attn.out_proj.bias', 'same'),
  ('norm2/scale', 'ln_2.weight', 'layer_norm2.weight', 'same'),
  ('norm2/bias', 'ln_2.bias', 'layer_norm2.bias', 'same'),
  ('mlp/Dense_0/kernel', 'mlp.c_fc.weight', 'mlp.fc1.weight', 'T'),
  ('mlp/Dense_0/bias', 'mlp.c_fc.bias', 'mlp.fc1.bias', 'same'),
  ('mlp/Dense_1/kernel', 'mlp.c_proj.weight', 'mlp.fc2.weight', 'T'),
  ('mlp/Dense_1/bias', 'mlp.c_proj.bias', 'mlp.fc2.bias', 'same'),
]


def mapping_rows(depth_image: int, depth_text: int):
  """All (tipsito, OpenCLIP, Hugging Face, layout) rows of an export tree with these depths."""
  rows = list(TOP_MAP) + list(IMAGE_MAP) + list(TEXT_MAP)
  for tower, depth in (('image', depth_image), ('text', depth_text)):
    pre = BLOCK_PREFIX[tower]
    for i in range(depth):
      rows += [
        tuple(p.format(i=i) + n for p, n in zip(pre, names)) + (layout,) for *names, layout in BLOCK_MAP
      ]
  return rows


def _to_torch(a, layout: str, hf: bool):
  """One tipsito array in the torch layout of OpenCLIP (hf=False) or Hugging Face (hf=True)."""
  a = np.asarray(a)
  if '|' in layout:
    layout = layout.split('|')[hf]
  if layout == 'same':
    return a
  if layout == 'T':
    return a.T
  if layout == 'conv':
    return a.transpose(3, 2, 0, 1)
  if layout == 'vec':
    return a.reshape(-1)
  if layout in ('q', 'k', 'v'):
    return a.reshape(a.shape[0], -1).T if a.ndim == 3 else a.reshape(-1)
  if layout == 'out':
    return a.reshape(-1, a.shape[-1]).T
  raise ValueError(layout)


def to_state_dicts(tree: dict, depth_image: int, depth_text: int):
  """(OpenCLIP state_dict, Hugging Face state_dict) of a tipsito export tree {image, text, image_proj}.

  Fails if a tipsito leaf is not mapped or mapped twice, or a torch name is written twice: the mapping
  is one-to-one (OpenCLIP's fused q/k/v being three disjoint row blocks of one array).
  """
  flat = {k: v for k, v in traverse_util.flatten_dict(tree, sep='/').items()}
  rows = mapping_rows(depth_image, depth_text)
  used = [r[0] for r in rows]
  assert len(used) == len(set(used)), 'a tipsito leaf mapped twice'
  assert set(used) == set(flat), (sorted(set(flat) - set(used)), sorted(set(used) - set(flat)))
  oc, hf, chunks = {}, {}, {}
  for ours, oc_name, hf_name, layout in rows:
    assert hf_name not in hf
    hf[hf_name] = _to_torch(flat[ours], layout, hf=True)
    arr = _to_torch(flat[ours], layout, hf=False)
    if layout in ('q', 'k', 'v'):
      chunks.setdefault(oc_name, {})[layout] = arr
    else:
      assert oc_name not in oc
      oc[oc_name] = arr
  for name, parts in chunks.items():
    assert sorted(parts) == ['k', 'q', 'v'] and name not in oc
    oc[name] = np.concatenate([parts['q'], parts['k'], parts['v']], 0)
  return oc, hf


class Strict(dict):
  """A state dict that records which names the reference forward read (all must be)."""

  def __init__(self, *a):
    super().__init__(*a)
    self.read = set()

  def __getitem__(self, k):
    self.read.add(k)
    return super().__getitem__(k)


# ------------------------------------------------------------------------------------------------
# Reference forward (numpy float64), written from OpenCLIP's / Hugging Face's module code.
# ------------------------------------------------------------------------------------------------
def _ln(x, w, b, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x):  # torch nn.GELU(): exact erf
  return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _block(x, p, heads, eps, causal):
  """OpenCLIP ResidualAttentionBlock: x += attn(ln_1 x); x += mlp(ln_2 x) (nn.MultiheadAttention)."""
  b, n, d = x.shape
  hd = d // heads
  h = _ln(x, p['ln1_w'], p['ln1_b'], eps)

  def split(w, bias):
    return (h @ w.T + bias).reshape(b, n, heads, hd).transpose(0, 2, 1, 3)

  q, k, v = (split(p[f'{c}_w'], p[f'{c}_b']) for c in 'qkv')
  logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
  if causal:  # OpenCLIP build_causal_mask: -inf above the diagonal (no padding mask)
    logits = logits + np.triu(np.full((n, n), -np.inf), 1)
  att = np.exp(logits - logits.max(-1, keepdims=True))
  att = att / att.sum(-1, keepdims=True)
  y = (att @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
  x = x + y @ p['o_w'].T + p['o_b']
  h = _gelu(_ln(x, p['ln2_w'], p['ln2_b'], eps) @ p['fc1_w'].T + p['fc1_b'])
  return x + h @ p['fc2_w'].T + p['fc2_b']


def _openclip_blocks(sd, prefix, depth):
  """Per-block weights from OpenCLIP names (in_proj split into q, k, v as nn.MultiheadAttention does)."""
  out = []
  for i in range(depth):
    g = lambda n, i=i: sd[f'{prefix}{i}.{n}']  # noqa: E731
    w, bias = np.split(g('attn.in_proj_weight'), 3), np.split(g('attn.in_proj_bias'), 3)
    out.append(
      dict(
        ln1_w=g('ln_1.weight'),
        ln1_b=g('ln_1.bias'),
        q_w=w[0],
        k_w=w[1],
        v_w=w[2],
        q_b=bias[0],
        k_b=bias[1],
        v_b=bias[2],
        o_w=g('attn.out_proj.weight'),
        o_b=g('attn.out_proj.bias'),
        ln2_w=g('ln_2.weight'),
        ln2_b=g('ln_2.bias'),
        fc1_w=g('mlp.c_fc.weight'),
        fc1_b=g('mlp.c_fc.bias'),
        fc2_w=g('mlp.c_proj.weight'),
        fc2_b=g('mlp.c_proj.bias'),
      )
    )
  return out


def _hf_blocks(sd, prefix, depth):
  """Per-block weights from Hugging Face CLIPEncoderLayer names."""
  out = []
  for i in range(depth):
    g = lambda n, i=i: sd[f'{prefix}{i}.{n}']  # noqa: E731
    p = dict(
      ln1_w=g('layer_norm1.weight'),
      ln1_b=g('layer_norm1.bias'),
      o_w=g('self_attn.out_proj.weight'),
      o_b=g('self_attn.out_proj.bias'),
      ln2_w=g('layer_norm2.weight'),
      ln2_b=g('layer_norm2.bias'),
      fc1_w=g('mlp.fc1.weight'),
      fc1_b=g('mlp.fc1.bias'),
      fc2_w=g('mlp.fc2.weight'),
      fc2_b=g('mlp.fc2.bias'),
    )
    for c in 'qkv':
      p[f'{c}_w'], p[f'{c}_b'] = g(f'self_attn.{c}_proj.weight'), g(f'self_attn.{c}_proj.bias')
    out.append(p)
  return out


def ref_image(sd, images, *, hf, depth, heads, mean, std, eps=1e-5, posemb=None):
  """OpenCLIP VisionTransformer.forward (or HF CLIPVisionTransformer + visual_projection).

  images: uint8 (B,H,W,3), normalised as OpenCLIP's preprocess (ToTensor, Normalize). Returns
  (pooled embedding (B,E), tokens after ln_post (B,N,D)). `posemb` overrides the position table
  (another resolution).
  """
  if hf:
    pre = 'vision_model.'
    w_patch, cls = sd[pre + 'embeddings.patch_embedding.weight'], sd[pre + 'embeddings.class_embedding']
    pos = sd[pre + 'embeddings.position_embedding.weight']
    ln_pre = (sd[pre + 'pre_layrnorm.weight'], sd[pre + 'pre_layrnorm.bias'])
    ln_post = (sd[pre + 'post_layernorm.weight'], sd[pre + 'post_layernorm.bias'])
    blocks, proj = _hf_blocks(sd, pre + 'encoder.layers.', depth), sd['visual_projection.weight'].T
  else:
    w_patch, cls, pos = (
      sd['visual.conv1.weight'],
      sd['visual.class_embedding'],
      sd['visual.positional_embedding'],
    )
    ln_pre = (sd['visual.ln_pre.weight'], sd['visual.ln_pre.bias'])
    ln_post = (sd['visual.ln_post.weight'], sd['visual.ln_post.bias'])
    blocks, proj = _openclip_blocks(sd, 'visual.transformer.resblocks.', depth), sd['visual.proj']
  pos = pos if posemb is None else posemb
  x = (np.asarray(images, np.float64) / 255.0 - np.asarray(mean)) / np.asarray(std)
  x = x.transpose(0, 3, 1, 2)  # NCHW
  b, c, hh, ww = x.shape
  d, _, p, _ = w_patch.shape
  patches = x.reshape(b, c, hh // p, p, ww // p, p)
  x = np.einsum('bcipjq,dcpq->bijd', patches, w_patch).reshape(b, -1, d)  # conv1, no bias
  x = np.concatenate([np.broadcast_to(cls, (b, 1, d)), x], 1) + pos
  x = _ln(x, *ln_pre, eps)
  for blk in blocks:
    x = _block(x, blk, heads, eps, causal=False)
  x = _ln(x, *ln_post, eps)  # OpenCLIP: ln_post on every token, then pool 'tok'; HF: on the pooled
  return x[:, 0] @ proj, x


def ref_text(sd, ids, *, hf, depth, heads, eos_id=None, eps=1e-5):
  """OpenCLIP CLIP.encode_text (argmax pooling) or HF CLIPTextTransformer + text_projection
  (pooled at the first `eos_id`). Returns (pooled embedding (B,E), tokens after ln_final (B,L,D))."""
  ids = np.asarray(ids)
  if hf:
    pre = 'text_model.'
    emb, pos = sd[pre + 'embeddings.token_embedding.weight'], sd[pre + 'embeddings.position_embedding.weight']
    ln_f = (sd[pre + 'final_layer_norm.weight'], sd[pre + 'final_layer_norm.bias'])
    blocks, proj = _hf_blocks(sd, pre + 'encoder.layers.', depth), sd['text_projection.weight'].T
    at = (ids == eos_id).argmax(-1)
  else:
    emb, pos = sd['token_embedding.weight'], sd['positional_embedding']
    ln_f = (sd['ln_final.weight'], sd['ln_final.bias'])
    blocks, proj = _openclip_blocks(sd, 'transformer.resblocks.', depth), sd['text_projection']
    at = ids.argmax(-1)  # text_global_pool 'argmax': the EOT is the largest id
  x = emb[ids] + pos[: ids.shape[1]]
  for blk in blocks:
    x = _block(x, blk, heads, eps, causal=True)
  x = _ln(x, *ln_f, eps)
  return x[np.arange(len(ids)), at] @ proj, x


# ------------------------------------------------------------------------------------------------
# Tiny towers with random (non-trivial) parameters.
# ------------------------------------------------------------------------------------------------
IMG_SIZE, PATCH, EMBED, MAX_LEN = 32, 16, 24, 16


@pytest.fixture(scope='module')
def tok():
  return tok_lib.Tokenizer(max_len=MAX_LEN, flavour='clip')


def image_cfg(**kw):
  return vit_config(
    'tiny/16',
    num_cls_tokens=1,
    posemb_grid=IMG_SIZE // PATCH,
    pixel_mean=presets.CLIP_PIXEL_MEAN,
    pixel_std=presets.CLIP_PIXEL_STD,
    **{**presets.IMAGE_STRUCTURE['openclip'], **kw},
  )


def text_cfg(vocab, **kw):
  return text_config(
    'tiny', vocab_size=vocab, max_len=MAX_LEN, out_dim=EMBED, **{**presets.TEXT_STRUCTURE['openclip'], **kw}
  )


def _randomise(tree, seed):
  """Flax init values plus N(0, 0.1) on every bias, LayerNorm scale, class token and position table, so
  that none is trivially 0 or 1 (as the TIPS conformance vectors do)."""
  rng = np.random.default_rng(seed)

  def f(path, a):
    name = jax.tree_util.keystr(path)
    if any(f"'{n}'" in name for n in ('bias', 'scale', 'cls', 'posemb')):
      a = a + rng.normal(0.0, 0.1, a.shape).astype(a.dtype)
    return a

  return jax.tree_util.tree_map_with_path(f, tree)


@pytest.fixture(scope='module')
def towers(tok):
  """(image module, text module, export tree {image, text, image_proj})."""
  vit = VisionTransformer(**image_cfg())
  txt = TextEncoder(**text_cfg(tok.vocab_size))
  pi = vit.init(jax.random.PRNGKey(0), jnp.zeros((1, IMG_SIZE, IMG_SIZE, 3)))['params']
  pt = txt.init(jax.random.PRNGKey(1), jnp.zeros((1, MAX_LEN), jnp.int32))['params']
  proj = jax.random.normal(jax.random.PRNGKey(2), (vit.width, EMBED)) * vit.width**-0.5
  tree = _randomise({'image': pi, 'text': pt, 'image_proj': {'kernel': proj}}, 0)
  return vit, txt, jax.tree.map(np.asarray, tree)


@pytest.fixture(scope='module')
def state_dicts(towers):
  vit, txt, tree = towers
  return to_state_dicts(jax.tree.map(lambda a: a.astype(np.float64), tree), vit.depth, txt.depth)


TEXTS = [
  'a red circle',
  '',
  'A large blue star at the top left, on a plain white background.',
  ' '.join(['circle'] * 30),
]  # the last one is truncated


def _images(n=3, size=IMG_SIZE, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def test_mapping_is_one_to_one(towers, state_dicts):
  """Every tipsito leaf maps to exactly one OpenCLIP / Hugging Face tensor (checked in
  `to_state_dicts`), nothing is added or lost, and OpenCLIP's names are its ViT-B-16 layout."""
  vit, txt, tree = towers
  oc, hf = state_dicts
  n_ours = sum(a.size for a in jax.tree.leaves(tree))
  assert sum(a.size for a in oc.values()) == sum(a.size for a in hf.values()) == n_ours
  assert 'image/patch_embed/bias' not in traverse_util.flatten_dict(tree, sep='/')  # conv1 bias=False
  d, n = vit.width, (IMG_SIZE // PATCH) ** 2
  assert oc['visual.positional_embedding'].shape == (n + 1, d)  # a row for the class token
  assert oc['visual.class_embedding'].shape == (d,)
  assert oc['visual.conv1.weight'].shape == (d, 3, PATCH, PATCH)
  assert oc['visual.transformer.resblocks.0.attn.in_proj_weight'].shape == (3 * d, d)
  assert oc['visual.proj'].shape == (d, EMBED) and hf['visual_projection.weight'].shape == (EMBED, d)
  assert oc['positional_embedding'].shape == (MAX_LEN, txt.width)
  assert oc['text_projection'].shape == (txt.width, EMBED)


@pytest.mark.parametrize('hf', [False, True], ids=['openclip', 'hf'])
def test_image_tower_equals_openclip_forward(towers, state_dicts, hf):
  """Flax image tower + image_proj == OpenCLIP's (and HF's) forward on the mapped weights: conv1
  without bias, class token with its own position row, ln_pre, exact GELU, LayerNorm 1e-5, ln_post,
  proj; every mapped tensor is read."""
  vit, _, tree = towers
  sd = Strict(state_dicts[hf])
  images = _images()
  pooled, tokens = ref_image(
    sd,
    images,
    hf=hf,
    depth=vit.depth,
    heads=vit.num_heads,
    mean=presets.CLIP_PIXEL_MEAN,
    std=presets.CLIP_PIXEL_STD,
  )
  image_keys = {k for k in sd if 'vision' in k or 'visual' in k}
  assert sd.read == image_keys
  out = vit.apply({'params': tree['image']}, images)
  emb = np.asarray(out['cls'][:, 0]) @ tree['image_proj']['kernel']
  np.testing.assert_allclose(emb, pooled, atol=1e-5, rtol=0)
  if not hf:  # OpenCLIP returns ln_post'ed patch tokens (HF's last_hidden_state is before its LN)
    g = IMG_SIZE // PATCH
    np.testing.assert_allclose(out['patches'], tokens[:, 1:].reshape(-1, g, g, vit.width), atol=1e-5, rtol=0)


@pytest.mark.parametrize('hf', [False, True], ids=['openclip', 'hf'])
def test_text_tower_equals_openclip_forward(towers, state_dicts, tok, hf):
  """Flax text tower (clip flavour) on the clip tokenizer's ids == OpenCLIP's encode_text (causal mask,
  argmax = EOT pooling, text_projection) and HF's (first eos_token_id = tok.eot_id)."""
  _, txt, tree = towers
  sd = Strict(state_dicts[hf])
  ids = tok.tokenize(TEXTS)
  pooled, tokens = ref_text(sd, ids, hf=hf, depth=txt.depth, heads=txt.num_heads, eos_id=tok.eot_id)
  assert sd.read == {k for k in sd if not ('vision' in k or 'visual' in k)}
  out = txt.apply({'params': tree['text']}, ids)
  np.testing.assert_allclose(out['pooled'], pooled, atol=1e-5, rtol=0)
  # Valid positions equal; after the EOT OpenCLIP also attends to padding keys, tipsito masks them.
  valid = ids != 0
  np.testing.assert_allclose(np.asarray(out['tokens'])[valid], tokens[valid], atol=1e-5, rtol=0)


def test_text_pools_the_eot(towers, tok):
  """The pooled vector (before the projection) is the token at the EOT, which the tokenizer writes last
  even when it truncates, and which is each row's largest id (OpenCLIP's argmax)."""
  _, txt, tree = towers
  ids = tok.tokenize(TEXTS)
  eot = np.argmax(ids == tok.eot_id, axis=-1)
  assert (ids[np.arange(len(ids)), eot] == tok.eot_id).all() and (ids.argmax(-1) == eot).all()
  assert eot[-1] == MAX_LEN - 1  # truncated row: EOT kept in the last slot
  m = TextEncoder(**{**text_cfg(tok.vocab_size), 'out_dim': None})
  params = {k: v for k, v in tree['text'].items() if k != 'proj'}
  out = m.apply({'params': params}, ids)
  np.testing.assert_array_equal(out['pooled'], np.asarray(out['tokens'])[np.arange(len(ids)), eot])


def test_image_tower_other_resolution(towers, state_dicts):
  """At another resolution the grid rows of the position table are resized as the TIPS table is
  (vit.resize_posemb) and the class row is kept: the OpenCLIP forward with that table agrees."""
  vit, _, tree = towers
  oc, _ = state_dicts
  size = 3 * PATCH
  pos = oc['visual.positional_embedding']
  g = IMG_SIZE // PATCH
  grid = np.asarray(
    vit_lib.resize_posemb(jnp.asarray(pos[1:], jnp.float32).reshape(1, g, g, -1), (3, 3)), np.float64
  ).reshape(9, -1)
  images = _images(2, size, seed=1)
  pooled, _ = ref_image(
    oc,
    images,
    hf=False,
    depth=vit.depth,
    heads=vit.num_heads,
    mean=presets.CLIP_PIXEL_MEAN,
    std=presets.CLIP_PIXEL_STD,
    posemb=np.concatenate([pos[:1], grid], 0),
  )
  out = vit.apply({'params': tree['image']}, images)
  assert out['patches'].shape[1:3] == (3, 3)
  np.testing.assert_allclose(
    np.asarray(out['cls'][:, 0]) @ tree['image_proj']['kernel'], pooled, atol=1e-5, rtol=0
  )


def _count(module, x):
  shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), x)['params']
  return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes)), shapes


# OpenCLIP's docs/model_profile.csv (image_mparams, text_mparams; projections included).
OPENCLIP_MPARAMS = {'B/16': (86.19, 63.43), 'L/16': (304.09, 123.65)}


@pytest.mark.parametrize('variant', ['B/16', 'L/16'])
def test_ito_towers_are_openclip_sized(variant):
  """ITO's towers (configs/ito_b16.py, ito_l16.py over tipsito/config/defaults.py) have OpenCLIP
  ViT-B-16 / ViT-L-16's parameter counts and map onto OpenCLIP's names with its shapes (197 position
  rows at 224 px, 77 text positions, 49408 ids)."""
  import importlib.util
  import pathlib
  from tipsito.models.kwargs import module_kwargs

  name = f"ito_{variant.replace('/', '').lower()}.py"
  path = pathlib.Path(__file__).parent.parent / 'configs' / name
  spec = importlib.util.spec_from_file_location(f'cfg_{name[:-3]}', path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  vit = VisionTransformer(**module_kwargs(c.model.image))
  txt = TextEncoder(**module_kwargs(c.model.text))
  n_img, p_img = _count(vit, jnp.zeros((1, 224, 224, 3)))
  n_txt, p_txt = _count(txt, jnp.zeros((1, c.max_len), jnp.int32))
  n_img += vit.width * c.model.embed_dim  # image_proj
  print(f'ITO {variant}: image {n_img:,} (+image_proj), text {n_txt:,} (+text_projection)')
  want_img, want_txt = OPENCLIP_MPARAMS[variant]
  assert abs(n_img / 1e6 - want_img) < 0.006 and abs(n_txt / 1e6 - want_txt) < 0.006
  tree = {
    'image': p_img,
    'text': p_txt,
    'image_proj': {'kernel': jax.ShapeDtypeStruct((vit.width, c.model.embed_dim), jnp.float32)},
  }
  zeros = jax.tree.map(lambda s: np.broadcast_to(np.float32(0), s.shape), tree)  # no memory
  oc, _ = to_state_dicts(zeros, vit.depth, txt.depth)
  assert oc['visual.positional_embedding'].shape == (197, vit.width)  # 14 x 14 + 1
  assert oc['token_embedding.weight'].shape == (49408, txt.width)
  assert oc['positional_embedding'].shape == (77, txt.width)


def test_export_round_trip_rebuilds_towers_and_tokenizer(towers, tok, tmp_path):
  """`tipsito.load` rebuilds the OpenCLIP towers from config.json (structure keys stated there) and
  tokenizes strings with SOT/EOT as training does."""
  import tipsito
  from tipsito import export_format

  vit, txt, tree = towers
  icfg, tcfg = image_cfg(), text_cfg(tok.vocab_size)
  out = export_format.write_export(
    tmp_path / 'e',
    image_config=icfg,
    text_config=tcfg,
    params=tree,
    temperature=0.07,
    tokenizer_path=tok_lib.DEFAULT_TOKENIZER,
    image_proj=True,
  )
  cfg = json.loads((tmp_path / 'e' / 'config.json').read_text())
  for k, v in presets.IMAGE_STRUCTURE['openclip'].items():
    assert cfg['image'][k] == v, k
  for k, v in presets.TEXT_STRUCTURE['openclip'].items():
    assert cfg['text'][k] == v, k
  enc = tipsito.load(out)
  assert enc.tokenizer.flavour == 'clip'
  np.testing.assert_array_equal(enc.tokenize(TEXTS), tok.tokenize(TEXTS))
  want = txt.apply({'params': tree['text']}, tok.tokenize(TEXTS))['pooled']
  np.testing.assert_allclose(enc.embed_texts(TEXTS), want, atol=1e-5, rtol=0)
  images = _images()
  want_img = np.asarray(vit.apply({'params': tree['image']}, images)['cls'])
  np.testing.assert_allclose(
    enc.embed_images(images, values=False, project=False)['cls'], want_img, atol=1e-5, rtol=0
  )


def test_clip_text_export_with_too_small_vocab_refuses_strings(towers, tok, tmp_path):
  """An export whose text embedding cannot hold the clip tokenizer's SOT/EOT (a 'clip' export from
  before they existed) loads for ids but refuses strings, instead of clamping the ids silently."""
  import tipsito
  from tipsito import export_format

  vit, txt, tree = towers
  small = tok.vocab_size - 2
  text = dict(tree['text'], token_emb={'embedding': tree['text']['token_emb']['embedding'][:small]})
  out = export_format.write_export(
    tmp_path / 'old',
    image_config=image_cfg(),
    text_config=text_cfg(small),
    params={**tree, 'text': text},
    temperature=0.07,
    tokenizer_path=tok_lib.DEFAULT_TOKENIZER,
    image_proj=True,
  )
  enc = tipsito.load(out)
  with pytest.raises(ValueError, match=rf"'clip' tokenizer has {tok.vocab_size} ids.*embeds {small}"):
    enc.embed_texts(['a red circle'])
  assert enc.embed_texts(np.ones((1, MAX_LEN), np.int32)).shape == (1, EMBED)


@pytest.mark.parametrize('flavour', ['clip', 'tips'])
def test_id_only_evals_tokenize_with_the_text_flavour(tok, flavour):
  """Evals of an export without a tokenizer tokenize with the configured model in the export's text
  flavour (SOT/EOT for 'clip'), as training did."""
  import types
  from tipsito.evals.registry import make_evaluator

  n = tok.vocab_size
  enc = types.SimpleNamespace(
    tokenizer=None, text_config={'flavour': flavour, 'max_len': MAX_LEN, 'vocab_size': n}
  )
  ev = make_evaluator('zs', {'type': 'zeroshot', 'dataset': 'shapes'})
  ids = ev._text_input(enc, ['a red circle'])
  want = tok_lib.Tokenizer(max_len=MAX_LEN, flavour=flavour).tokenize(['a red circle'])
  np.testing.assert_array_equal(ids, want)
  assert (ids[0, 0] == tok.sot_id) == (flavour == 'clip')


def test_training_encoder_of_ito_is_openclip():
  """Training-time evals (tipsito/train/exporting.py training_encoder) see the ITO recipe's OpenCLIP towers
  and tokenize with SOT/EOT; the text embedding holds them (vocab_size from the tokenizer)."""
  from tipsito.train import exporting
  from tipsito.config import defaults
  from tipsito.train import step as step_lib

  c = defaults.tiny_config('ito', image_size=IMG_SIZE)
  setup = step_lib.build(c)
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), setup.state_shapes.params)
  enc = exporting.training_encoder(setup, params)
  assert enc.tokenizer.flavour == 'clip'
  assert enc.text_config['vocab_size'] == enc.tokenizer.vocab_size == enc.tokenizer.eot_id + 1
  for k, v in presets.IMAGE_STRUCTURE['openclip'].items():
    assert enc.image_config[k] == v, k
  assert 'norm_pre' in enc.params['image'] and 'bias' not in enc.params['image']['patch_embed']


def test_scanned_openclip_towers_equal_unrolled(towers, tok):
  """`scan=True` (params stacked by tipsito/models/layer_stack.py) gives the unrolled OpenCLIP towers'
  outputs: ln_pre, the class position row and the block settings (eps, GELU) reach the scanned blocks."""
  from tipsito.models import layer_stack

  vit, txt, tree = towers
  images, ids = _images(2), tok.tokenize(TEXTS)
  svit = VisionTransformer(**image_cfg(scan=True))
  stxt = TextEncoder(**text_cfg(tok.vocab_size, scan=True))
  got = svit.apply({'params': layer_stack.stack_tower(tree['image'])}, images)
  want = vit.apply({'params': tree['image']}, images)
  np.testing.assert_allclose(got['cls'], want['cls'], atol=1e-5, rtol=0)
  got = stxt.apply({'params': layer_stack.stack_tower(tree['text'])}, ids)['pooled']
  np.testing.assert_allclose(got, txt.apply({'params': tree['text']}, ids)['pooled'], atol=1e-5, rtol=0)


def test_activations_by_name():
  """The FFN activations a config (and an exporter) can name; an unknown one lists the valid names."""
  from tipsito.models import layers

  x = jnp.linspace(-4.0, 4.0, 101)
  np.testing.assert_allclose(layers.activation_fn('quick_gelu')(x), x * jax.nn.sigmoid(1.702 * x), atol=1e-7)
  np.testing.assert_allclose(
    layers.activation_fn('gelu_exact')(x), _gelu(np.asarray(x, np.float64)), atol=1e-6
  )
  assert not np.allclose(
    layers.activation_fn('gelu')(x), layers.activation_fn('gelu_exact')(x), atol=1e-5
  )  # tanh GELU (TIPS) is not OpenCLIP's
  with pytest.raises(ValueError, match=r"activation 'swish' unknown.*'gelu_exact'.*'quick_gelu'"):
    layers.activation_fn('swish')
