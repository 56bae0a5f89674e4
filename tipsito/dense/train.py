"""`python -m tipsito.dense.train`: train a DPT head on a frozen image tower, evaluate it, export it.

    python -m tipsito.dense.train --encoder workdirs/demo/export --task depth --data scenes \\
      --workdir workdirs/dpt_depth --steps 300

Why frozen features computed once: the tower never changes (the TIPSv2 protocol trains the heads on
frozen backbones), so its block outputs for every train and eval image are computed once, with
`VisionTransformer(..., return_blocks=...)`, and a step is the head alone. The run (docs/dense-heads.md):

1. The encoder: a tipsito export (`tipsito.load`), a Hugging Face Tipsv2 folder (official or exported
   TIPS weights, tipsito/interop/hf_tipsv2.py), or a `tipsv2_dpt` folder (tipsito/interop/hf_dpt.py),
   whose head of `--task` then initialises the head (fine-tuning a released head; its DPT shape wins).
2. Data (tipsito/dense/data.py): scenes (generated), nyuv2 or ade20k (read from --data_dir).
3. The head (tipsito/models/dpt.py) trained with optax AdamW (b1 0.9, b2 0.999, --weight_decay), linear
   warm-up over the first 10% of --steps then cosine decay to 0 (`optax.warmup_cosine_decay_schedule`);
   the loss of the task (tipsito/dense/eval.py). Batch k is drawn from `fold_in(PRNGKey(seed), k)`, so the
   run is a pure function of the seed: a resumed run is the uninterrupted run (checked by
   tests/test_dense_train.py).
4. Orbax checkpoints of {params, opt_state, step} every --ckpt_every steps and at the end, with the
   main loop's `Checkpointer` (tipsito/train/checkpointing.py); an existing workdir resumes from its latest
   checkpoint (after checking that its `dense_config.json` matches the flags that fix the run).
5. A progress line every --log_every steps (step, it/s, ETA, loss, lr), TensorBoard scalars (clu, under
   the workdir: `loss`, `lr`, `eval/<metric>`), evals every --eval_every steps and at the end, written to
   `<workdir>/eval.json`.
6. `--export DIR` writes the tower and the head as a `tipsv2_dpt` folder that transformers' `Tipsv2DptFor*`
   opens (TIPS-style towers only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tipsito.dense import data as data_lib
from tipsito.models import dpt as dpt_lib
from tipsito.dense import eval as eval_lib
from tipsito.models import kwargs as kwargs_lib
from tipsito.models.vit import VisionTransformer

# Flags whose change makes a workdir a different run (refused on resume).
RUN_KEYS = (
  'task',
  'data',
  'seed',
  'image_size',
  'train_examples',
  'batch_size',
  'lr',
  'weight_decay',
  'steps',
  'dpt',
)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog='python -m tipsito.dense.train', description=__doc__.split('\n')[0])
  p.add_argument('--encoder', required=True, help='tipsito export, Tipsv2 folder, or tipsv2_dpt folder')
  p.add_argument('--task', required=True, choices=dpt_lib.TASKS)
  p.add_argument('--data', default='scenes', choices=data_lib.DATASETS)
  p.add_argument('--data_dir', default=None, help='the benchmark folder (nyuv2, ade20k)')
  p.add_argument('--workdir', required=True)
  p.add_argument('--steps', type=int, default=300)
  p.add_argument('--batch_size', type=int, default=16)
  p.add_argument('--lr', type=float, default=1e-3)
  p.add_argument('--weight_decay', type=float, default=1e-4)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--image_size', type=int, default=64, help='the square model input (px)')
  p.add_argument('--train_examples', type=int, default=2000)
  p.add_argument('--eval_examples', type=int, default=200)
  p.add_argument('--train_split', default='train')
  p.add_argument('--eval_split', default='test')
  p.add_argument('--eval_every', type=int, default=0, help='0: only at the end')
  p.add_argument('--log_every', type=int, default=50)
  p.add_argument('--ckpt_every', type=int, default=100)
  p.add_argument('--layers', default=None, help='tower stages read, e.g. 3,6,9,12 (default: evenly spaced)')
  p.add_argument('--neck_hidden_sizes', default='96,192,384,768')
  p.add_argument('--reassemble_factors', default='4,2,1,0.5', help='one resize factor per stage read')
  p.add_argument('--fusion_hidden_size', type=int, default=256)
  p.add_argument('--num_depth_bins', type=int, default=256)
  p.add_argument('--min_depth', type=float, default=1e-3)
  p.add_argument('--max_depth', type=float, default=10.0)
  p.add_argument('--eigen_crop', action='store_true', help='NYUv2: score the Eigen crop only')
  p.add_argument('--slide', action='store_true', help='segmentation: sliding-window evaluation')
  p.add_argument(
    '--stop_at', type=int, default=None, help='stop after this step (checkpointed), as a preemption'
  )
  p.add_argument('--export', default=None, help='write a tipsv2_dpt folder here at the end')
  return p.parse_args(argv)


def _ints(s: Optional[str]) -> Optional[tuple[int, ...]]:
  return None if s is None else tuple(int(x) for x in s.split(',') if x.strip())


def load_encoder(path: str) -> tuple[dict, Any, Optional[dict]]:
  """(image_config, image params, the tipsv2_dpt folder's reading or None) of --encoder."""
  from tipsito.interop import hf_dpt, hf_tipsv2  # optional dependency: safetensors  # pylint: disable=g-import-not-at-top

  cfg_file = os.path.join(path, 'config.json')
  if not os.path.isfile(cfg_file):
    raise FileNotFoundError(f'--encoder {path}: no config.json (expected a tipsito export or a HF folder)')
  with open(cfg_file) as f:
    model_type = json.load(f).get('model_type')
  if model_type == hf_dpt.MODEL_TYPE:
    r = hf_dpt.read_hf_dpt(path)
    return r['image_config'], r['image_params'], r
  if model_type == hf_tipsv2.MODEL_TYPE:
    r = hf_tipsv2.read_hf_tipsv2(path)
    return r['image_config'], r['params']['image'], None
  import tipsito  # heavy: the inference stack  # pylint: disable=g-import-not-at-top

  enc = tipsito.load(path)
  return enc.image_config, enc.params['image'], None


def frozen_blocks(image_config, params, images: np.ndarray, stages, batch: int = 64) -> list[dict]:
  """The tower's normed blocks at `stages` for all images: [{'cls': (N, 1, D), 'patches': (N, h, w, D)}].

  Only the first CLS token is kept: the DPT readout reads no other."""
  vit = VisionTransformer(**kwargs_lib.module_kwargs(image_config, VisionTransformer))
  fn = jax.jit(lambda p, x: vit.apply({'params': p}, x, return_blocks=stages)['blocks'])
  outs = [fn(params, jnp.asarray(images[i : i + batch])) for i in range(0, len(images), batch)]
  return [
    {
      'cls': np.concatenate([np.asarray(o[k]['cls'][:, :1]) for o in outs]),
      'patches': np.concatenate([np.asarray(o[k]['patches']) for o in outs]),
    }
    for k in range(len(stages))
  ]


def _take(blocks, idx):
  return [{k: v[idx] for k, v in b.items()} for b in blocks]


def loss_fn(cfg: dpt_lib.DPTConfig, task: str, split: data_lib.DenseSplit):
  """(params, blocks, targets) -> scalar loss of `task`."""

  def f(params, blocks, t):
    out = dpt_lib.DPTHead(cfg, task).apply({'params': params}, blocks)
    if task == 'depth':
      return eval_lib.depth_loss(
        dpt_lib.bins_to_depth(out, cfg), t['depth'], split.min_depth, split.max_depth
      )
    if task == 'normals':
      return eval_lib.normals_loss(out, t['normals'], t['normals_valid'])
    return eval_lib.segmentation_loss(out, t['segmentation'], split.ignore_index)

  return f


def evaluate(
  cfg, task, params, blocks, split: data_lib.DenseSplit, *, eigen_crop=False, slide_fn=None
) -> dict:
  """The task's metrics on an eval split (tipsito/dense/eval.py protocols)."""
  predict = jax.jit(lambda p, b: dpt_lib.predict(cfg, task, p, b))
  n = len(split)
  preds = eval_lib.batched(lambda i, j: predict(params, _take(blocks, slice(i, j))), n, 32)
  if task == 'depth':
    return eval_lib.depth_metrics(
      list(preds), split.native['depth'], split.min_depth, split.max_depth, eigen_crop
    )
  if task == 'normals':
    return eval_lib.normals_metrics(list(preds), split.native['normals'], split.native['normals_valid'])
  if slide_fn is not None:
    preds = [slide_fn(im) for im in split.native['image']]
  return eval_lib.segmentation_metrics(
    list(preds), split.native['segmentation'], cfg.num_labels, split.ignore_index
  )


def make_optimizer(steps: int, lr: float, weight_decay: float) -> optax.GradientTransformation:
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), max(steps, 2), 0.0)
  return optax.adamw(sched, b1=0.9, b2=0.999, weight_decay=weight_decay), sched


def _check_run(workdir: str, run: dict) -> None:
  path = os.path.join(workdir, 'dense_config.json')
  if os.path.isfile(path):
    with open(path) as f:
      old = json.load(f)
    diff = sorted(k for k in RUN_KEYS if old.get(k) != run.get(k))
    if diff:
      raise SystemExit(
        f'{path}: this workdir is a run with other {diff} '
        f'({", ".join(f"{k}={old.get(k)!r}" for k in diff)}); use a new --workdir or the same flags'
      )
  else:
    os.makedirs(workdir, exist_ok=True)
    with open(path, 'w') as f:
      json.dump(run, f, indent=2)


def train(args: argparse.Namespace) -> dict:
  """The whole run; returns the final metrics."""
  from tipsito.train import checkpointing  # heavy: Orbax  # pylint: disable=g-import-not-at-top
  from tipsito.train import observability  # heavy: clu  # pylint: disable=g-import-not-at-top

  image_config, tower, released = load_encoder(args.encoder)
  patch = int(image_config['patch_size'])
  if args.image_size % patch:
    raise SystemExit(f'--image_size {args.image_size} is not a multiple of the patch size {patch}')
  train_split = data_lib.load_split(
    args.data,
    args.train_split,
    image_size=args.image_size,
    max_examples=args.train_examples,
    data_dir=args.data_dir,
  )
  eval_split = data_lib.load_split(
    args.data,
    args.eval_split,
    image_size=args.image_size,
    max_examples=args.eval_examples,
    data_dir=args.data_dir,
  )
  need = {'depth': 'depth', 'normals': 'normals', 'segmentation': 'segmentation'}[args.task]
  if need not in train_split.targets:
    raise SystemExit(f'--data {args.data} has no {need} targets for --task {args.task}')
  if released is not None:
    cfg = released['dpt_config']
  else:
    cfg = dpt_lib.DPTConfig(
      layers=_ints(args.layers),
      neck_hidden_sizes=_ints(args.neck_hidden_sizes),
      reassemble_factors=tuple(float(x) for x in args.reassemble_factors.split(',')),
      fusion_hidden_size=args.fusion_hidden_size,
      num_depth_bins=args.num_depth_bins,
      min_depth=args.min_depth,
      max_depth=args.max_depth,
      num_labels=max(train_split.num_classes, 1),
    )
  stages = cfg.stages(int(image_config['depth']))
  run = {k: getattr(args, k) for k in RUN_KEYS if k != 'dpt'}
  run['dpt'] = cfg.to_dict()
  run['encoder'] = os.path.abspath(args.encoder)
  _check_run(args.workdir, run)

  t0 = time.time()
  train_blocks = frozen_blocks(image_config, tower, train_split.images, stages)
  eval_blocks = frozen_blocks(image_config, tower, eval_split.images, stages)
  print(
    f'frozen features: {len(train_split)} train / {len(eval_split)} eval images in {time.time() - t0:.1f}s',
    flush=True,
  )

  key = jax.random.PRNGKey(args.seed)
  params = dpt_lib.init_head(cfg, args.task, _take(train_blocks, slice(0, 1)), seed=args.seed)
  if released is not None and args.task in released['heads']:
    params = jax.tree_util.tree_map(jnp.asarray, released['heads'][args.task])
  opt, sched = make_optimizer(args.steps, args.lr, args.weight_decay)
  state = {'params': params, 'opt_state': opt.init(params), 'step': jnp.asarray(0, jnp.int32)}
  ckpt = checkpointing.Checkpointer(
    os.path.join(args.workdir, 'checkpoints'), every_steps=args.ckpt_every, keep=2
  )
  if ckpt.latest_step() is not None:
    state, _ = ckpt.restore(jax.tree_util.tree_map(np.asarray, state), with_data=False)
    state = jax.tree_util.tree_map(jnp.asarray, state)
    print(f'resumed from step {int(state["step"])}', flush=True)

  targets = {k: jnp.asarray(v) for k, v in train_split.targets.items()}
  dev_blocks = jax.tree_util.tree_map(jnp.asarray, train_blocks)
  f = loss_fn(cfg, args.task, train_split)
  n = len(train_split)

  @jax.jit
  def step(state):
    k = jax.random.fold_in(key, state['step'])
    idx = jax.random.randint(k, (args.batch_size,), 0, n)
    loss, g = jax.value_and_grad(f)(
      state['params'], _take(dev_blocks, idx), {kk: v[idx] for kk, v in targets.items()}
    )
    upd, opt_state = opt.update(g, state['opt_state'], state['params'])
    return {
      'params': optax.apply_updates(state['params'], upd),
      'opt_state': opt_state,
      'step': state['step'] + 1,
    }, loss

  writer = observability.create_writer(args.workdir, process_index=0)
  history = []

  slide_fn = None
  if args.slide:
    if args.task != 'segmentation' or not eval_split.native.get('image'):
      raise SystemExit('--slide: sliding-window evaluation is for --task segmentation')
    vit = VisionTransformer(**kwargs_lib.module_kwargs(image_config, VisionTransformer))
    window_fn = jax.jit(
      lambda p, x: dpt_lib.DPTHead(cfg, 'segmentation').apply(
        {'params': p}, vit.apply({'params': tower}, x, return_blocks=stages)['blocks']
      )
    )

  def run_eval(s):
    if args.slide:
      nonlocal slide_fn
      slide_fn = lambda im: eval_lib.slide_logits(  # noqa: E731
        im, args.image_size, patch, lambda x: window_fn(state['params'], jnp.asarray(x)), cfg.num_labels
      )
    m = evaluate(
      cfg, args.task, state['params'], eval_blocks, eval_split, eigen_crop=args.eigen_crop, slide_fn=slide_fn
    )
    writer.write_scalars(s, {f'eval/{k}': v for k, v in m.items()})
    history.append(dict(step=s, **m))
    print(f'eval at step {s}: ' + ', '.join(f'{k} {v:.4g}' for k, v in m.items()), flush=True)
    return m

  start, t_start = int(state['step']), time.time()
  for s in range(start + 1, args.steps + 1):
    state, loss = step(state)
    if s % args.log_every == 0 or s == args.steps:
      loss = float(loss)
      rate = (s - start) / max(time.time() - t_start, 1e-9)
      eta = (args.steps - s) / max(rate, 1e-9)
      lr = float(sched(s))
      print(
        f'step {s}/{args.steps} | {rate:.1f} it/s | ETA {eta:.0f}s | loss {loss:.4g} | lr {lr:.3g}',
        flush=True,
      )
      writer.write_scalars(s, {'loss': loss, 'lr': lr})
    saved = ckpt.should_save(s) or s == args.steps
    if saved:
      ckpt.save(s, state, force=s == args.steps)
    if args.eval_every and s % args.eval_every == 0 and s != args.steps:
      run_eval(s)
    if args.stop_at is not None and s == args.stop_at:
      if not saved:
        ckpt.save(s, state, force=True)
      ckpt.wait()
      ckpt.close()
      print(f'stopped at step {s} (--stop_at); rerun the same command to resume', flush=True)
      return {}
  ckpt.wait()
  final = run_eval(int(state['step']))
  writer.flush()
  with open(os.path.join(args.workdir, 'eval.json'), 'w') as fh:
    json.dump({'final': final, 'history': history}, fh, indent=2)
  if args.export:
    from tipsito.interop import hf_dpt  # optional dependency: safetensors  # pylint: disable=g-import-not-at-top

    names = None
    if args.task == 'segmentation' and args.data == 'scenes':
      names = ['background'] + list(data_lib.scenes_gen.CLASSES)
    hf_dpt.write_hf_dpt(
      args.export,
      image_config=image_config,
      image_params=tower,
      cfg=cfg,
      heads={args.task: jax.tree_util.tree_map(np.asarray, state['params'])},
      image_size=args.image_size,
      label_names=names,
    )
    print(f'exported to {args.export}', flush=True)
  ckpt.close()
  return final


def main(argv: Optional[Sequence[str]] = None) -> int:
  train(parse_args(argv))
  return 0


if __name__ == '__main__':
  sys.exit(main())
