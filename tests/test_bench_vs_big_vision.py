"""tipsito/bench/vs_big_vision.py: the side-by-side step against big_vision's two-tower CLIP.

Why: the parity numbers in docs/performance.md come from this tool; these tests keep it runnable and keep
its big_vision side honest (big_vision's own loss and towers at tipsito's shapes). big_vision is not a
dependency: the tests that run it need a local checkout named by TIPSITO_BIG_VISION (the directory holding
the `big_vision` package) and skip otherwise. The error for a missing checkout is tested always.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import app
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tipsito.bench import vs_big_vision as bench
from tipsito.losses import contrastive

BIG_VISION = os.environ.get("TIPSITO_BIG_VISION")
needs_big_vision = pytest.mark.skipif(
  not BIG_VISION,
  reason="no big_vision checkout: set TIPSITO_BIG_VISION to the directory holding the big_vision package",
)


def test_missing_or_wrong_checkout_is_a_clear_error(tmp_path):
  with pytest.raises(app.UsageError, match="--big_vision is required"):
    bench.big_vision_root(None)
  with pytest.raises(app.UsageError, match=f"--big_vision={tmp_path}: no big_vision/models"):
    bench.big_vision_root(str(tmp_path))


def test_unknown_recipe_or_toggle_is_a_clear_error():
  with pytest.raises(app.UsageError, match="--recipes: 'siglip'"):
    bench.run_side_by_side("/nonexistent", ["siglip"])
  with pytest.raises(app.UsageError, match="--toggles: 'fast'"):
    bench.run_side_by_side("/nonexistent", ["clip"], toggles=["fast"])


@needs_big_vision
def test_big_vision_softmax_loss_is_tipsito_clip_loss():
  """The loss big_vision's rows run (read from its CLIP trainer) is tipsito's clip_loss (known answer)."""
  bv = bench.import_big_vision(bench.big_vision_root(BIG_VISION))
  rs = np.random.RandomState(0)
  zimg, ztxt = (rs.normal(size=(6, 8)).astype(np.float32) for _ in range(2))
  zimg, ztxt = (z / np.linalg.norm(z, axis=-1, keepdims=True) for z in (zimg, ztxt))
  t = jnp.float32(7.0)
  mesh = Mesh(np.asarray(jax.devices()[:1]), ("batch",))
  bv_loss = jax.jit(
    jax.shard_map(lambda a, b: bv.softmax_loss(a, b, t)[0], mesh=mesh, in_specs=P("batch"), out_specs=P())
  )(zimg, ztxt)
  np.testing.assert_allclose(bv_loss, contrastive.clip_loss(zimg, ztxt, t), rtol=1e-6)


@needs_big_vision
def test_tiny_side_by_side_rows():
  """Tiny shapes (about a minute): both sides compile and run at the same shapes, the ratios are to
  big_vision's row, and big_vision's exact-GELU row really changes its towers."""
  rows = bench.run_side_by_side(
    BIG_VISION, ["clip"], variant="tiny/16", batch=4, steps=1, toggles=["bv_exact_gelu"], log=lambda s: None
  )
  by = {r["row"]: r for r in rows}
  assert list(by) == ["clip", "big_vision clip", "big_vision clip +exact_gelu"]
  ours, bv, bv_exact = by["clip"], by["big_vision clip"], by["big_vision clip +exact_gelu"]
  for r in rows:
    assert r["step_s"] > 0 and r["temp_MiB"] > 0 and r["flops"] > 0 and r["sys_s"] >= 0
    # No loop in either step: XLA's count is the matmuls' plus the element-wise work, so at least this one.
    assert 0.5 * r["flops"] < r["matmul_gflop"] * 1e9 <= r["flops"], r
  assert bv["gflop_vs_bv"] == bv["temp_MiB_vs_bv"] == bv["step_s_vs_bv"] == 1.0
  # Same towers, batch and loss, but our last blocks compute only the rows the loss reads (the CLS and EOT
  # rows; tipsito/objective/features.py), so fewer FLOPs: at this depth (2 text blocks) a third fewer.
  assert 0.5 < ours["flops"] / bv["flops"] < 1.0
  # The time per round as a ratio to big_vision's (one round: a median, no interval); none on its own row.
  assert ours["step_ratio_paired"]["rounds"] == 1 and ours["step_ratio_paired"]["lo"] is None
  assert "step_ratio_paired" not in bv
  # erf's polynomial costs more than tanh's: the toggle reached big_vision's MLP blocks.
  assert bv_exact["flops"] > bv["flops"]
  # Our rows are also timed against the exact-GELU row, round by round (one round: the ratio itself). The
  # rows hold both times and the ratio rounded to 1e-4 s and 1e-4, which bounds how far they can differ.
  a, b = ours["step_s"], bv_exact["step_s"]
  assert ours["step_ratio_paired_exact_gelu"]["median"] == pytest.approx(
    a / b, abs=0.5e-4 + (a / b) * (0.5e-4 / a + 0.5e-4 / b) * 1.01
  )
  assert not any("step_ratio_paired_exact_gelu" in r for r in (bv, bv_exact))
  header, _, *lines = bench.markdown_table(rows).splitlines()
  assert header.endswith("| time vs big_vision +exact_gelu per round: median [CI] |")
  assert all(line.count("|") == header.count("|") for line in lines)


def test_remat_toggles_set_both_towers_policy():
  """`--toggles remat_P` rows: both towers' blocks rematerialised with policy P, nothing else changed."""
  base = bench.tipsito_config("clip", "tiny/16", 8)
  for policy in ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
    c = bench.tipsito_config("clip", "tiny/16", 8, toggles=[f"remat_{policy}"])
    for tower in ("image", "text"):
      assert (c.model[tower].remat, c.model[tower].remat_policy) == (True, policy)
      c.model[tower].update(dict(remat=base.model[tower].remat, remat_policy=base.model[tower].remat_policy))
    assert c.to_dict() == base.to_dict()


def test_scan_sets_both_towers_as_big_vision_scans():
  """`--scan`: both towers scanned with blocks rematerialised under nothing_saveable (big_vision's vit.py
  under its `scan`), nothing else changed."""
  base = bench.tipsito_config("clip", "tiny/16", 8)
  c = bench.tipsito_config("clip", "tiny/16", 8, scan=True)
  for tower in ("image", "text"):
    assert (c.model[tower].scan, c.model[tower].remat, c.model[tower].remat_policy) == (
      True,
      True,
      "nothing_saveable",
    )
    c.model[tower].update({k: base.model[tower][k] for k in ("scan", "remat", "remat_policy")})
  assert c.to_dict() == base.to_dict()


TOPOLOGY_ROWS = [
  dict(row="clip", recipe="clip", topology="v5e:2x2", batch_per_chip=64, flops=8.0e12, gflop=8000.0,
       temp_MiB=3000.0, total_MiB=3900.0),
  dict(row="big_vision clip", recipe="clip", topology="v5e:2x2", batch_per_chip=64, flops=7.9e12, gflop=7900.0,
       temp_MiB=3100.0, total_MiB=4000.0),
]  # fmt: skip


def test_topology_rows_table():
  """Rows compiled for a topology print as the per-chip table (no step-time column), ratios to big_vision's."""
  rows = [dict(r, **{f"{k}_vs_bv": round(r[k] / TOPOLOGY_ROWS[1][k], 3) for k in ("temp_MiB", "total_MiB")},
               gflop_vs_bv=round(r["flops"] / 7.9e12, 3)) for r in TOPOLOGY_ROWS]  # fmt: skip
  assert bench.markdown_table(rows).splitlines() == [
    "| row | topology | batch per chip | GFLOP/step per chip | temporaries (MiB) | total (MiB) "
    "| FLOPs vs big_vision | temporaries vs big_vision | total vs big_vision |",
    "|---|---|---|---|---|---|---|---|---|",
    "| clip | v5e:2x2 | 64 | 8000.0 | 3000.0 | 3900.0 | 1.013 | 0.968 | 0.975 |",
    "| big_vision clip | v5e:2x2 | 64 | 7900.0 | 3100.0 | 4000.0 | 1.000 | 1.000 | 1.000 |",
  ]


def test_timed_rows_table():
  """Rows timed on this machine print step time, system CPU time per step and the ratios; compiled-only rows
  (--steps 0) and rows of an older --jsonl without a system time print '-' there."""
  rows = [
    dict(row="ito", gflop=1919.5, temp_MiB=4037.3, step_s=7.54, sys_s=2.8, gflop_vs_bv=1.044,
         temp_MiB_vs_bv=0.922, step_s_vs_bv=1.015),
    dict(row="big_vision ito", gflop=1838.5, temp_MiB=4376.6, step_s=7.427, gflop_vs_bv=1.0, temp_MiB_vs_bv=1.0,
         step_s_vs_bv=1.0),
    dict(row="ito -fusion", gflop=1843.2, temp_MiB=3823.9, gflop_vs_bv=1.003, temp_MiB_vs_bv=0.874),
  ]  # fmt: skip
  rows[0]["step_ratio_paired"] = dict(rounds=12, median=1.0151, lo=1.003, hi=1.031, level=0.9614)
  rows[1]["step_ratio_paired"] = dict(rounds=5, median=1.0, lo=None, hi=None, level=None)
  rows[0]["matmul_gflop_vs_bv"], rows[1]["matmul_gflop_vs_bv"] = 1.1049, 1.0  # the last row: an older --jsonl
  assert bench.markdown_table(rows).splitlines()[2:] == [
    "| ito | 1919.5 | 4037.3 | 7.540 | 2.80 | 1.044 | 1.105 | 0.922 | 1.015 | 1.015 [1.003, 1.031] 96%, 12 rounds |",
    "| big_vision ito | 1838.5 | 4376.6 | 7.427 | - | 1.000 | 1.000 | 1.000 | 1.000 | 1.000 (no interval: 5 rounds) |",
    "| ito -fusion | 1843.2 | 3823.9 | - | - | 1.003 | - | 0.874 | - | - |",
  ]


def test_executed_matmul_flops_count_loops_and_recomputes_that_xla_counts_once():
  """`executed_matmul_flops` of a traced step: a `scan` of matmuls counts its body times its length, where
  XLA's cost analysis counts the body once (why the bench has the column); the gradient of a
  rematerialised matmul chain counts the recompute; a value never used counts nothing (XLA drops it too); a
  `cond` its costliest branch; a convolution 2 x outputs x window x input features."""
  m, k, n = 8, 16, 32
  x, w = jnp.ones((m, k)), jnp.ones((k, k))
  mm = 2.0 * m * k * k

  def loop(x, w):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0]

  traced = jax.jit(loop).trace(x, w)
  assert bench.executed_matmul_flops(traced.jaxpr) == 5 * mm
  xla = traced.lower().compile().cost_analysis()
  xla = (xla[0] if isinstance(xla, (list, tuple)) else xla)["flops"]
  assert xla < 2 * mm  # one body's worth (its matmul and tanh), not five
  chain = lambda x, w: jnp.sum(jax.checkpoint(lambda x: jnp.sin(x @ w) @ w)(x))  # noqa: E731
  # forward 2 matmuls; backward: the first again (the recompute of sin(x w), the second's operand) and 2 per
  # matmul (input and weight gradients)
  assert bench.executed_matmul_flops(jax.jit(jax.value_and_grad(chain, (0, 1))).trace(x, w).jaxpr) == 7 * mm
  dead = lambda x: (x @ w @ w, jnp.sum(x @ w))[0]  # noqa: E731  the second value is never used
  assert bench.executed_matmul_flops(jax.jit(dead).trace(x).jaxpr) == 2 * mm
  branches = lambda p, x: jax.lax.cond(p, lambda x: x @ w @ w, lambda x: x @ w, x)  # noqa: E731
  assert bench.executed_matmul_flops(jax.jit(branches).trace(True, x).jaxpr) == 2 * mm
  img, kernel = jnp.ones((2, 8, 8, 3)), jnp.ones((4, 4, 3, n))
  conv = lambda i: jax.lax.conv_general_dilated(
    i, kernel, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )  # noqa: E731
  assert bench.executed_matmul_flops(jax.jit(conv).trace(img).jaxpr) == 2.0 * (2 * 2 * 2 * n) * (4 * 4 * 3)


def test_paired_ratio_interval_is_the_distribution_free_interval_of_the_median():
  """Round-by-round ratios (the two steps of a round share the machine's load), their median, and the
  order-statistic interval of the median: ranks k and n + 1 - k with P(Binomial(n, 1/2) < k) <= 2.5 %
  (n = 12: ranks 3 and 10, coverage 1 - 2 x 79/4096; n = 20: ranks 6 and 15); none below 6 rounds.
  Paired: a load that slows both steps of a round cancels (ratios of medians would not see it).
  Break check: ranks one further in (k + 1) fail the n = 12 case."""
  ratios = np.array([1.05, 0.97, 1.01, 0.99, 1.02, 1.00, 1.03, 0.98, 1.04, 0.96, 1.06, 0.95])
  load = np.array([1.0, 3.0, 1.0, 2.0, 1.0, 5.0, 1.0, 1.0, 2.0, 1.0, 4.0, 1.0])  # both sides alike
  p = bench.paired_ratio_interval(ratios * load, load)
  sorted_r = np.sort(ratios)
  assert (p["rounds"], p["lo"], p["hi"]) == (12, sorted_r[2], sorted_r[9])
  assert p["median"] == pytest.approx(np.median(ratios)) and p["level"] == pytest.approx(
    1 - 2 * 79 / 4096, abs=1e-4
  )
  p20 = bench.paired_ratio_interval(np.arange(1.0, 21.0), np.ones(20))
  assert (p20["lo"], p20["hi"]) == (6.0, 15.0) and p20["level"] >= 0.95
  assert bench.paired_ratio_interval([1.0] * 5, [1.0] * 5)["lo"] is None
  assert bench.paired_ratio_interval([1.0] * 6, [1.0] * 6)["level"] == pytest.approx(1 - 2 / 64, abs=1e-4)


def test_warmup_runs_the_row_with_most_temporaries_first_then_rounds_in_row_order():
  """The warm-up step of each row runs in order of decreasing temporaries (under jemalloc with freed memory
  retained, the later rows then reuse the largest row's memory instead of each mapping its own: the 4-row
  `--toggles bv_fusion` run held 22-23 GiB in the rows' order); the timed rounds keep the rows' order,
  and each row's median is its own steps'. Break check: warming up in the rows' order fails it."""
  calls = []

  def entry(name, temp):
    return {"row": {"row": name, "temp_MiB": temp}, "run": lambda: calls.append(name) or jnp.zeros(())}

  entries = [entry("ito", 4037.3), entry("big_vision ito", 4376.6), entry("ito -fusion", 3604.4)]
  entries.append(entry(bench.FUSION_ROW, 5548.6))
  bench.time_interleaved(entries, steps=2)
  warm = [bench.FUSION_ROW, "big_vision ito", "ito", "ito -fusion"]
  rows = [e["row"]["row"] for e in entries]
  assert calls == warm + rows + rows
  assert all(len(e["times"]) == 2 and e["row"]["step_s"] >= 0 for e in entries)


def test_bad_topology_or_batch_is_a_clear_error_before_any_compile():
  """An unknown chip generation, or a global batch the chips do not divide, is refused naming the flag
  (from tipsito/planning/pod.py's topology check; without libtpu the error says how to install it)."""
  from tipsito.planning import pod as plan  # pylint: disable=import-outside-toplevel

  with pytest.raises(app.UsageError, match="--topology|tpu-plan"):
    bench.run_side_by_side("/nonexistent", ["clip"], topology="v9x:2x2")
  if not plan.libtpu_available():
    pytest.skip("libtpu not installed: the batch check needs the topology's chip count")
  with pytest.raises(app.UsageError, match="--batch=6: not a multiple of the 4 chips of --topology=v5e:2x2"):
    bench.run_side_by_side("/nonexistent", ["clip"], batch=6, topology="v5e:2x2")


@pytest.mark.skipif(
  not (BIG_VISION and os.environ.get("TIPSITO_TPU_BENCH")),
  reason="TPU compile (minutes of CPU): set TIPSITO_TPU_BENCH=1 and TIPSITO_BIG_VISION",
)
def test_tiny_rows_compiled_for_a_tpu_topology():
  """Both steps compiled ahead of time for v5e:2x2 (libtpu): per-chip numbers, ratios to big_vision's."""
  rows = bench.run_side_by_side(
    BIG_VISION, ["clip"], variant="tiny/16", batch=8, topology="v5e:2x2", log=lambda s: None
  )
  ours, bv = rows
  assert (ours["row"], bv["row"]) == ("clip", "big_vision clip")
  for r in rows:
    assert r["topology"] == "v5e:2x2" and r["batch_per_chip"] == 2 and r["flops"] > 0 and r["total_MiB"] > 0
    assert "step_s" not in r
  assert bv["total_MiB_vs_bv"] == bv["gflop_vs_bv"] == 1.0
  assert 0.9 < ours["flops"] / bv["flops"] < 1.2


def test_uint8_normalisation_costs_no_temporary_beyond_the_float_conversion():
  """Issue 43's "fold the uint8-to-float normalisation where it saves a copy", measured (docs/performance.md):
  the gradient of the patch embedding compiled with the normalisation inside (tipsito/models/vit.py
  `preprocess`: uint8 -> /255 -> (x - mean) / std -> centre pad) has the XLA:CPU temporaries of the bare
  uint8 -> float32 conversion (any fold of the constants into the patch kernel still converts), also when
  rematerialised from the uint8 image (`jax.checkpoint`); handing the float image in as an argument
  (big_vision's way) moves exactly one float image out of the temporaries into the arguments. So folding saves
  no copy. Batch 8 at 224 px, width 64 (seconds to compile)."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  from tipsito.models import vit  # pylint: disable=import-outside-toplevel

  mean, std = (
    jnp.asarray((0.48145466, 0.4578275, 0.40821073)),
    jnp.asarray((0.26862954, 0.26130258, 0.27577711)),
  )
  conv = nn.Conv(64, (16, 16), strides=(16, 16), padding="VALID", use_bias=False)

  def normalise(u8):
    return vit.center_pad((u8.astype(jnp.float32) / 255.0 - mean) / std, 16)

  def loss(embed):
    return lambda p, x: jnp.sum(jnp.tanh(embed(p, x)) ** 2)

  inside = loss(lambda p, u8: conv.apply(p, normalise(u8)))
  remat = loss(jax.checkpoint(lambda p, u8: conv.apply(p, normalise(u8))))
  convert_only = loss(lambda p, u8: conv.apply(p, u8.astype(jnp.float32)))
  argument = loss(conv.apply)
  params = jax.eval_shape(lambda: conv.init(jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3))))
  u8 = jax.ShapeDtypeStruct((8, 224, 224, 3), jnp.uint8)
  f32 = jax.ShapeDtypeStruct((8, 224, 224, 3), jnp.float32)

  def temp(fn, x):
    return jax.jit(jax.grad(fn)).lower(params, x).compile().memory_analysis().temp_size_in_bytes

  t_inside, t_remat, t_convert, t_argument = (
    temp(inside, u8),
    temp(remat, u8),
    temp(convert_only, u8),
    temp(argument, f32),
  )
  assert t_inside == t_remat == t_convert, (t_inside, t_remat, t_convert)
  assert 0 < t_inside - t_argument <= 8 * 224 * 224 * 3 * 4, (t_inside, t_argument)


def test_fusion_remat_toggles_set_the_fusion_policy_only():
  """`--toggles fusion_remat_P` rows (with `--recipes ito`): the fusion module's blocks rematerialised with
  policy P, the towers and everything else unchanged."""
  base = bench.tipsito_config("ito", "tiny/16", 8)
  for policy in ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
    c = bench.tipsito_config("ito", "tiny/16", 8, toggles=[f"fusion_remat_{policy}"])
    assert (c.model.fusion.remat, c.model.fusion.remat_policy) == (True, policy)
    c.model.fusion.update(dict(remat=base.model.fusion.remat, remat_policy=base.model.fusion.remat_policy))
    assert c.to_dict() == base.to_dict()


def test_jax_nn_attention_toggle_swaps_the_core_while_the_step_is_traced():
  """`--toggles jax_nn_attention`: tipsito's step traced with jax.nn's attention (5-D dot products under
  its vmap over query groups) instead of `layers._xla_core` (4-D only), and the core restored after."""
  import re  # pylint: disable=import-outside-toplevel

  from tipsito.models import layers  # pylint: disable=import-outside-toplevel

  def dot_ranks(toggles):
    with bench._attention_of(toggles):
      fn = lambda q: jnp.sum(layers.attention_core(q, q, q, None, False, "xla", True))  # noqa: E731
      text = jax.jit(jax.grad(fn)).lower(jnp.ones((2, 5, 2, 8))).as_text()
    return {r.count("x") for r in re.findall(r"stablehlo\.dot_general.*-> tensor<((?:\d+x)+)", text)}

  saved = layers._xla_core, layers._xla_core_recomputed
  assert dot_ranks(["jax_nn_attention"]) >= {5}
  assert (layers._xla_core, layers._xla_core_recomputed) == saved
  assert dot_ranks([]) == {4}


def test_reference_fusion_is_our_fusion_module():
  """`ReferenceFusion` (toggle bv_fusion: ITO's fusion written from flax's stock layers, every row computed)
  runs our `FusionTransformer`'s parameters unchanged and computes the same unit vectors and gradients, so
  the big_vision row with it times the same function as ours. Padded text keys change the output (the mask
  reaches both)."""
  from tipsito.models import fusion  # pylint: disable=import-outside-toplevel

  rs = np.random.RandomState(0)
  b, side, di, length, dt = 3, 3, 24, 6, 16
  cls, patches = rs.normal(size=(b, di)), rs.normal(size=(b, side, side, di))
  tokens = rs.normal(size=(b, length, dt))
  valid = np.arange(length)[None, :] < np.array([[2], [6], [4]])
  cls, patches, tokens = (jnp.asarray(x, jnp.float32) for x in (cls, patches, tokens))
  ours = fusion.FusionTransformer(width=32, depth=2, num_heads=4, mlp_ratio=2, max_text_len=8)
  params = ours.init(jax.random.PRNGKey(0), cls, patches, tokens, valid)["params"]
  ref = bench.ReferenceFusion(width=32, depth=2, num_heads=4, mlp_ratio=2, max_text_len=8)
  image_tokens = jnp.concatenate([cls[:, None], patches.reshape(b, side * side, di)], axis=1)
  assert jax.tree.structure(ref.init(jax.random.PRNGKey(0), image_tokens, tokens, valid)["params"]) == (
    jax.tree.structure(params)
  )

  def loss(apply, p, *inputs):
    return jnp.sum(apply({"params": p}, *inputs) * jnp.arange(32.0))

  want, want_grads = jax.value_and_grad(loss, argnums=(1, 2, 3))(
    ours.apply, params, cls, patches, tokens, valid
  )
  got, got_grads = jax.value_and_grad(loss, argnums=(1, 2))(ref.apply, params, image_tokens, tokens, valid)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(
    ref.apply({"params": params}, image_tokens, tokens, valid),
    ours.apply({"params": params}, cls, patches, tokens, valid),
    atol=2e-6,
  )
  scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want_grads[0]))
  for g, w in zip(jax.tree.leaves(got_grads[0]), jax.tree.leaves(want_grads[0])):
    np.testing.assert_allclose(g, w, atol=1e-5 * scale)  # float rounding of the largest gradient
  np.testing.assert_allclose(got_grads[1][:, 0], want_grads[1], atol=1e-5)
  np.testing.assert_allclose(got_grads[1][:, 1:], want_grads[2].reshape(b, side * side, di), atol=1e-5)
  all_valid = ref.apply({"params": params}, image_tokens, tokens, np.ones_like(valid))
  assert not np.allclose(
    all_valid[0], ref.apply({"params": params}, image_tokens, tokens, valid)[0], atol=1e-4
  )


def test_bv_fusion_toggle_needs_timed_ito():
  for recipes, kw in ((["clip"], {}), (["ito"], dict(topology="v5e:1x1")), (["ito"], dict(steps=0))):
    with pytest.raises(app.UsageError, match="--toggles=bv_fusion"):
      bench.run_side_by_side("/nonexistent", recipes, toggles=["bv_fusion"], **kw)


@needs_big_vision
def test_tiny_ito_rows_against_big_vision_with_the_reference_fusion():
  """Toggle bv_fusion: a big_vision `ito` row with ITO's fusion loss (`ReferenceFusion`), which adds the
  module's matmuls to big_vision's step; our `ito` rows carry their FLOPs and times as ratios to it."""
  rows = bench.run_side_by_side(
    BIG_VISION, ["ito"], variant="tiny/16", batch=4, steps=1, toggles=["bv_fusion"], log=lambda s: None
  )
  by = {r["row"]: r for r in rows}
  assert list(by) == ["ito", "big_vision ito", "ito -fusion", bench.FUSION_ROW]
  fused, bv = by[bench.FUSION_ROW], by["big_vision ito"]
  assert fused["matmul_gflop"] > bv["matmul_gflop"]
  # Our `ito` computes the module's last block for the CLS row only, so fewer of its matmuls: between the
  # towers alone and big_vision with the whole module.
  assert by["ito -fusion"]["matmul_gflop"] < by["ito"]["matmul_gflop"] < fused["matmul_gflop"] + 1e-9
  for name in ("ito", "ito -fusion"):
    r = by[name]
    assert r["matmul_gflop_vs_bv_fusion"] == round(r["matmul_gflop"] / fused["matmul_gflop"], 3)
    assert r["step_ratio_paired_bv_fusion"]["rounds"] == 1
  assert not any("step_ratio_paired_bv_fusion" in r for r in (bv, fused))
  header, _, *lines = bench.markdown_table(rows).splitlines()
  assert header.endswith(f"| time vs {bench.FUSION_ROW} per round: median [CI] |")
  assert all(line.count("|") == header.count("|") for line in lines)
