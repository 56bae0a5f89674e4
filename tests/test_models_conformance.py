"""Conformance of tipsito's towers with the official TIPS Scenic release.

Why: released TIPS weights must load through `tipsito.tips_import` and give the
official outputs (tests/data/tips_model, computed by running the official
code). Each vector set is checked twice: through the importer
(`Encoder.from_params` on the imported tree) and through the full
export -> `tipsito.load` round trip, so the on-disk format cannot drift.
Tolerances are the ones prescribed by the conformance README.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import tipsito
from tipsito import export_format
from tipsito import inference
from tipsito import tips_import

TOL = dict(rtol=1e-4, atol=5e-5)
MODELS = ('vit_mlp', 'vit_swiglu')
SIZES = {'224': 'images_224', '448': 'image_448', 'odd_200x300': 'image_odd_200x300'}


@pytest.fixture(scope='module')
def tips_dir(conformance_dir):
  return conformance_dir / 'tips_model'


@pytest.fixture(scope='module')
def vectors(tips_dir):
  return dict(np.load(tips_dir / 'tips_vectors.npz'))


@pytest.fixture(scope='module')
def encoders(tips_dir, tmp_path_factory):
  """{(model, source): Encoder} for source in ('import', 'export')."""
  out = {}
  for m in MODELS:
    image_npz = tips_dir / f'tiny_{m}_vision.npz'
    text_npz = tips_dir / 'tiny_text.npz'
    icfg, tcfg, params, temp = tips_import.import_tips_npz(image_npz, text_npz)
    out[(m, 'import')] = inference.Encoder.from_params(icfg, tcfg, params, temp)
    d = tmp_path_factory.mktemp(f'export_{m}')
    export_format.write_export(
      d, image_config=icfg, text_config=tcfg, params=params, temperature=temp, tokenizer_path=None
    )
    out[(m, 'export')] = tipsito.load(d)
  return out


def _normalize(x):
  """feature_viz.normalize of the official code: x / max(||x||, 1e-3)."""
  x = np.asarray(x, np.float64)
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-3)


@pytest.mark.parametrize('source', ['import', 'export'])
@pytest.mark.parametrize('model', MODELS)
def test_vision_outputs(encoders, vectors, model, source):
  enc = encoders[(model, source)]
  for size, key in SIZES.items():
    with_values = size != 'odd_200x300'
    out = enc.embed_images(vectors[key], values=with_values)
    np.testing.assert_allclose(
      out['patches'], vectors[f'{model}_patch_{size}'], **TOL, err_msg=f'{model} patch {size}'
    )
    np.testing.assert_allclose(
      out['cls'], vectors[f'{model}_cls_{size}'], **TOL, err_msg=f'{model} cls {size}'
    )
    if with_values:
      np.testing.assert_allclose(
        out['values'],
        vectors[f'{model}_valuetrick_patch_{size}'],
        **TOL,
        err_msg=f'{model} value trick {size}',
      )


@pytest.mark.parametrize('source', ['import', 'export'])
def test_text_and_zeroshot(encoders, vectors, source):
  for model in MODELS:
    enc = encoders[(model, source)]
    assert abs(enc.temperature - float(vectors['temperature'])) < 1e-9
    text = np.asarray(enc.embed_texts(vectors['text_ids']))
    np.testing.assert_allclose(text, vectors['text_emb'], **TOL)
    tn = _normalize(text)
    np.testing.assert_allclose(tn, vectors['text_emb_normalized'], **TOL)
    out = enc.embed_images(vectors['images_224'])
    cls0 = _normalize(out['cls'][:, 0])
    np.testing.assert_allclose(cls0, vectors[f'{model}_cls0_normalized_224'], **TOL)
    cos = cls0 @ tn.T
    np.testing.assert_allclose(cos, vectors[f'{model}_zeroshot_cos_224'], **TOL)
    logits = cos / enc.temperature
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, vectors[f'{model}_zeroshot_probs_224'], rtol=1e-4, atol=1e-4)
    v = np.asarray(out['values'], np.float64)
    vn = v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
    seg = np.einsum('cd,bhwd->bchw', tn, vn)
    np.testing.assert_allclose(seg, vectors[f'{model}_valuetrick_cos_224'], **TOL)


def test_export_params_bit_equal(encoders):
  import jax

  for m in MODELS:
    a = jax.tree_util.tree_leaves_with_path(encoders[(m, 'import')].params)
    b = dict(jax.tree_util.tree_leaves_with_path(encoders[(m, 'export')].params))
    assert len(a) == len(b)
    for path, leaf in a:
      np.testing.assert_array_equal(np.asarray(b[path]), np.asarray(leaf))


def test_importer_uses_every_key(tips_dir):
  for m in MODELS:
    flat = dict(np.load(tips_dir / f'tiny_{m}_vision.npz'))
    cfg, params = tips_import.import_tips_vision(flat)
    import jax

    assert len(jax.tree_util.tree_leaves(params)) == len(flat)
    assert cfg['num_cls_tokens'] == 2 and cfg['posemb_grid'] == 32
    assert cfg['ffn'] == ('swiglu' if m == 'vit_swiglu' else 'mlp')
    assert (cfg['width'], cfg['depth'], cfg['num_heads'], cfg['mlp_dim'], cfg['patch_size']) == (
      64,
      2,
      4,
      128,
      14,
    )
  flat = dict(np.load(tips_dir / 'tiny_text.npz'))
  cfg, params, temp = tips_import.import_tips_text(flat)
  assert len(jax.tree_util.tree_leaves(params)) == len(flat) - 1
  assert (cfg['vocab_size'], cfg['width'], cfg['depth'], cfg['num_heads'], cfg['mlp_dim']) == (
    32000,
    64,
    2,
    4,
    128,
  )
  assert temp == pytest.approx(0.0125)


def test_importer_missing_key(tips_dir):
  flat = dict(np.load(tips_dir / 'tiny_vit_mlp_vision.npz'))
  key = 'encoder/transformer/encoderblock_1/LayerNorm_0/scale'
  del flat[key]
  with pytest.raises(tips_import.CheckpointFormatError) as e:
    tips_import.import_tips_vision(flat)
  assert key in str(e.value) and '(64,)' in str(e.value)
  tflat = dict(np.load(tips_dir / 'tiny_text.npz'))
  del tflat['temperature_contrastive']
  with pytest.raises(tips_import.CheckpointFormatError, match='temperature_contrastive'):
    tips_import.import_tips_text(tflat)


def test_importer_misshapen_key(tips_dir):
  flat = dict(np.load(tips_dir / 'tiny_vit_swiglu_vision.npz'))
  key = 'encoder/transformer/encoderblock_1/FFNSwiGluFused_0/Dense_2/kernel'
  flat[key] = np.zeros((80, 64), np.float32)
  with pytest.raises(tips_import.CheckpointFormatError) as e:
    tips_import.import_tips_vision(flat)
  msg = str(e.value)
  assert key in msg and '(80, 64)' in msg and '(88, 64)' in msg
  tflat = dict(np.load(tips_dir / 'tiny_text.npz'))
  key = 'transformer/encoderblock_0/MultiHeadDotProductAttention_0/out/bias'
  tflat[key] = np.zeros((63,), np.float32)
  with pytest.raises(tips_import.CheckpointFormatError) as e:
    tips_import.import_tips_text(tflat)
  assert key in str(e.value) and '(63,)' in str(e.value)
  assert '(64,)' in str(e.value)


def test_importer_unexpected_key(tips_dir):
  flat = dict(np.load(tips_dir / 'tiny_vit_mlp_vision.npz'))
  flat['encoder/extra/thing'] = np.zeros((3,), np.float32)
  with pytest.raises(tips_import.CheckpointFormatError, match='encoder/extra/thing'):
    tips_import.import_tips_vision(flat)


def test_export_cli(tips_dir, vectors, tmp_path):
  """`python -m tipsito.export` end to end (with a tokenizer), then load."""
  tok_mod = pytest.importorskip('tipsito.data.tokenizer')
  out = tmp_path / 'exported'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  subprocess.run(
    [
      sys.executable,
      '-m',
      'tipsito.export',
      f'--tips_image_npz={tips_dir / "tiny_vit_mlp_vision.npz"}',
      f'--tips_text_npz={tips_dir / "tiny_text.npz"}',
      f'--tokenizer={tok_mod.DEFAULT_TOKENIZER}',
      f'--output={out}',
    ],
    check=True,
    env=env,
    cwd=os.path.dirname(os.path.dirname(__file__)),
    capture_output=True,
  )
  assert (out / 'tokenizer.model').is_file()
  enc = tipsito.load(out)
  assert enc.config['tokenizer'] == 'tokenizer.model'
  np.testing.assert_allclose(enc.embed_texts(vectors['text_ids']), vectors['text_emb'], **TOL)
  texts = ['a photo of a cat', 'A red square on a blue background']
  ids = enc.tokenize(texts)
  assert ids.shape == (2, 64) and ids.dtype == np.int32
  np.testing.assert_array_equal(enc.embed_texts(texts), enc.embed_texts(ids))


def test_no_tokenizer_error(encoders, vectors):
  enc = encoders[('vit_mlp', 'export')]
  assert enc.tokenizer is None and enc.config['tokenizer'] is None
  with pytest.raises(ValueError, match='tokenizer'):
    enc.embed_texts(['a photo'])


def test_export_refuses_training_parts(tips_dir, tmp_path):
  icfg, tcfg, params, temp = tips_import.import_tips_npz(
    tips_dir / 'tiny_vit_mlp_vision.npz', tips_dir / 'tiny_text.npz'
  )
  kw = dict(image_config=icfg, text_config=tcfg, temperature=temp)
  bad = dict(params, fusion={'w': np.zeros(3, np.float32)})
  with pytest.raises(ValueError, match='fusion'):
    export_format.write_export(tmp_path / 'a', params=bad, **kw)
  bad = dict(params, dino_head={'w': np.zeros(3, np.float32)})
  with pytest.raises(ValueError, match='dino_head'):
    export_format.write_export(tmp_path / 'b', params=bad, **kw)
  bad = dict(params, image=dict(params['image'], mask_token=np.zeros(64, np.float32)))
  with pytest.raises(ValueError, match='mask_token'):
    export_format.write_export(tmp_path / 'c', params=bad, **kw)
  assert not (tmp_path / 'a').exists()
  train_like = dict(
    params,
    fusion={'w': 0},
    dino_head={'w': 0},
    logit_scale=0.0,
    image=dict(params['image'], mask_token=np.zeros(64)),
  )
  kept = export_format.select_export_params(train_like)
  assert sorted(kept) == ['image', 'text']
  assert 'mask_token' not in kept['image']


def test_export_with_image_proj(tips_dir, vectors, tmp_path):
  """CLIP/ITO-style exports carry image_proj; project=True applies it."""
  icfg, tcfg, params, temp = tips_import.import_tips_npz(
    tips_dir / 'tiny_vit_mlp_vision.npz', tips_dir / 'tiny_text.npz'
  )
  kernel = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
  params = dict(params, image_proj={'kernel': kernel})
  with pytest.raises(ValueError, match='image_proj'):
    export_format.write_export(
      tmp_path / 'x', image_config=icfg, text_config=tcfg, params=params, temperature=temp
    )
  export_format.write_export(
    tmp_path / 'p',
    image_config=icfg,
    text_config=tcfg,
    params=params,
    temperature=temp,
    image_proj=True,
    extra={'recipe': 'clip'},
  )
  enc = tipsito.load(tmp_path / 'p')
  assert enc.config['image_proj'] and enc.config['extra'] == {'recipe': 'clip'}
  out = enc.embed_images(vectors['images_224'], project=True, values=False)
  assert out['cls'].shape == (2, 2, 8) and out['patches'].shape == (2, 16, 16, 8)
  np.testing.assert_allclose(out['cls'], vectors['vit_mlp_cls_224'] @ kernel, rtol=1e-4, atol=1e-4)
