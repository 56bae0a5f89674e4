"""Metric tests against hand-computed cases (why: every reported number goes through these functions)."""

import math

import numpy as np
import pytest

from tipsito.evals import metrics
from tipsito.evals import templates


# ----------------------------------------------------------------------------------------------- top-k
def test_topk_hand_case_and_padding():
  scores = np.array(
    [
      [0.1, 0.5, 0.4],  # label 2: top1 -> 1 (miss), top2 -> {1,2} (hit)
      [0.9, 0.05, 0.05],  # label 0: hit at 1
      [0.2, 0.3, 0.5],
    ]
  )  # label 0: top2 -> {2,1} (miss)
  labels = np.array([2, 0, 0])
  acc = metrics.topk_accuracy(scores, labels, ks=(1, 2, 5))
  assert acc[1] == pytest.approx(1 / 3)
  assert acc[2] == pytest.approx(2 / 3)
  assert acc[5] == pytest.approx(1.0)  # k > C is clipped: everything is in the top 3
  # A padded row that *would* be correct is never counted (neither as correct nor in the denominator).
  scores_p = np.concatenate([scores, [[10.0, 0, 0]]])
  labels_p = np.concatenate([labels, [0]])
  valid = np.array([1, 1, 1, 0], bool)
  assert metrics.topk_accuracy(scores_p, labels_p, (1,), valid)[1] == pytest.approx(1 / 3)
  assert metrics.topk_correct(scores_p, labels_p, (1,), valid)[1] == 1
  # Ties go to the lower index (deterministic): a constant row is correct at top1 only for class 0.
  assert metrics.topk_correct(np.zeros((2, 3)), np.array([0, 1]), (1,))[1] == 1


# ------------------------------------------------------------------------------------------ retrieval
SIM = np.array([[0.1, 0.9, 0.8, 0.2], [0.7, 0.6, 0.5, 0.1]])
T2I = np.array([0, 0, 1, 1])  # two captions per image


def test_recall_several_captions_hand_case():
  r = metrics.retrieval_recall(SIM, T2I, ks=(1, 2, 3))
  # image 0: its best caption (t1, 0.9) is ranked first -> hit@1.
  # image 1: its captions score 0.5, 0.1; t0 (0.7) and t1 (0.6) are higher -> rank 2 -> hit only at 3.
  assert r["i2t"] == {1: 0.5, 2: 0.5, 3: 1.0}
  # t0 -> img0 0.1 < img1 0.7 (miss@1); t1 -> 0.9 > 0.6 (hit); t2 -> own img1 0.5 < 0.8 (miss);
  # t3 -> own img1 0.1 < 0.2 (miss). All hit at 2 (only two images).
  assert r["t2i"] == {1: 0.25, 2: 1.0, 3: 1.0}
  i2t, t2i = metrics.retrieval_ranks(SIM, T2I)
  np.testing.assert_array_equal(i2t, [0, 2])
  np.testing.assert_array_equal(t2i, [1, 0, 1, 1])


def test_recall_padding_never_counted():
  # Add a padded image and a padded text that beat everything: results must not change.
  sim = np.full((3, 5), 5.0)
  sim[:2, :4] = SIM
  t2i = np.array([0, 0, 1, 1, 2])
  iv = np.array([1, 1, 0], bool)
  tv = np.array([1, 1, 1, 1, 0], bool)
  r = metrics.retrieval_recall(sim, t2i, ks=(1, 2, 3), image_valid=iv, text_valid=tv)
  assert r["i2t"] == {1: 0.5, 2: 0.5, 3: 1.0}
  assert r["t2i"] == {1: 0.25, 2: 1.0, 3: 1.0}


def test_recall_ties_do_not_inflate():
  # All similarities equal: the positive is tied with a negative that comes first -> not a hit at 1.
  sim = np.zeros((2, 2))
  r = metrics.retrieval_recall(sim, np.array([0, 1]), ks=(1, 2))
  assert r["i2t"][1] == 0.5 and r["i2t"][2] == 1.0


def test_chunked_retrieval_matches_dense():
  from tipsito.evals.retrieval import retrieval_recall_chunked

  rng = np.random.default_rng(0)
  img = rng.normal(size=(13, 8)).astype(np.float32)
  txt = rng.normal(size=(30, 8)).astype(np.float32)
  t2i = rng.integers(0, 13, size=30)
  t2i[:13] = np.arange(13)  # every image has at least one caption
  dense = metrics.retrieval_recall(img @ txt.T, t2i, ks=(1, 5, 10))
  chunked = retrieval_recall_chunked(img, txt, t2i, ks=(1, 5, 10), chunk_size=4)
  assert dense == chunked


# ----------------------------------------------------------------------------------------------- mIoU
GT = np.array([[[0, 0, 1], [1, 255, 2]]], np.uint8)
PRED = np.array([[[0, 1, 1], [1, 0, 0]]], np.int32)


def test_miou_ignore_and_absent_classes():
  # Counted pixels (the 255 one is skipped): g0p0, g0p1, g1p1, g1p1, g2p0.
  # class 0: TP 1, |gt| 2, |pred| 2 -> 1/3; class 1: TP 2, |gt| 2, |pred| 3 -> 2/3; class 2: 0/1 -> 0;
  # class 3: absent from both -> excluded. mIoU = (1/3 + 2/3 + 0) / 3.
  r = metrics.miou_from_confusion(metrics.confusion_matrix(PRED, GT, num_classes=4))
  np.testing.assert_allclose(r["iou"][:3], [1 / 3, 2 / 3, 0.0])
  assert math.isnan(r["iou"][3])
  assert r["miou"] == pytest.approx(1 / 3)
  assert r["pixel_acc"] == pytest.approx(3 / 5)


def test_chance_miou_is_what_uniform_random_predictions_score():
  # Hand case: C = 2, shares 3/4 and 1/4 -> (0.75 / 1.75 + 0.25 / 1.25) / 2.
  hand = metrics.chance_miou_from_confusion(np.array([[3, 0], [0, 1]]))
  assert hand == pytest.approx((0.75 / 1.75 + 0.25 / 1.25) / 2)
  # Imbalanced ground truth of 22 classes (one holds about a quarter, as openclipart's test split): the
  # mIoU of uniformly random predictions over 2M pixels, averaged over 3 draws, equals the formula.
  rng = np.random.default_rng(0)
  c = 22
  share = rng.dirichlet(np.full(c, 0.7))
  gt = rng.choice(c, size=2_000_000, p=share)
  chance = metrics.chance_miou_from_confusion(metrics.confusion_matrix(gt, gt, c))
  drawn = np.mean([metrics.miou(rng.integers(0, c, gt.shape), gt, c) for _ in range(3)])
  assert drawn == pytest.approx(chance, rel=1e-2)
  assert not chance == pytest.approx(1 / c, rel=0.1)  # not 1/C: the reason the number is reported
  assert math.isnan(metrics.chance_miou_from_confusion(np.zeros((3, 3))))


def test_confusion_accumulates_and_skips_padded_images():
  cm = metrics.ConfusionMatrix(4)
  cm.update(PRED[:, :1], GT[:, :1])
  cm.update(PRED[:, 1:], GT[:, 1:])
  # A padded image predicting everything wrong must not change anything.
  junk_pred = np.full((1, 2, 3), 3)
  junk_gt = np.zeros((1, 2, 3), np.uint8)
  cm.update(
    np.concatenate([junk_pred, junk_pred]), np.concatenate([junk_gt, junk_gt]), valid=np.array([False, False])
  )
  np.testing.assert_array_equal(cm.matrix, metrics.confusion_matrix(PRED, GT, 4))
  assert cm.compute()["miou"] == pytest.approx(1 / 3)
  assert metrics.miou(PRED, GT, 4) == pytest.approx(1 / 3)


# ------------------------------------------------------------------------------------------------ kNN
BANK = np.array([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]], np.float32)
BANK_LABELS = np.array([0, 1, 1, 0])


def test_knn_weighting_hand_case():
  q = np.array([[1.0, 0.0]], np.float32)
  # k=3 neighbours: sims 1 (class 0), 0.8 (class 1), 0 (class 1). T=0.5: weights e^2, e^1.6, e^0.
  votes = metrics.knn_votes(q, BANK, BANK_LABELS, num_classes=2, k=3, temperature=0.5)
  np.testing.assert_allclose(votes[0], [np.exp(2.0), np.exp(1.6) + 1.0], rtol=1e-6)
  assert metrics.knn_accuracy(q, [0], BANK, BANK_LABELS, 2, k=3, temperature=0.5, ks=(1,))[1] == 1.0
  # With a large temperature the weights are almost equal and the 2-vs-1 majority (class 1) wins.
  assert metrics.knn_accuracy(q, [1], BANK, BANK_LABELS, 2, k=3, temperature=100.0, ks=(1,))[1] == 1.0


def test_knn_padded_bank_and_queries_never_counted():
  q = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
  # A padded bank entry identical to query 0 with label 1 must not vote.
  bank = np.concatenate([BANK, [[1.0, 0.0]]])
  labels = np.concatenate([BANK_LABELS, [1]])
  bv = np.array([1, 1, 1, 1, 0], bool)
  v = metrics.knn_votes(q, bank, labels, 2, k=3, temperature=0.5, bank_valid=bv)
  np.testing.assert_allclose(v[0], [np.exp(2.0), np.exp(1.6) + 1.0], rtol=1e-6)
  # More neighbours asked than valid entries: the missing ones contribute nothing (no NaN).
  v = metrics.knn_votes(q, bank, labels, 2, k=5, temperature=0.5, bank_valid=bv)
  assert np.all(np.isfinite(v))
  np.testing.assert_allclose(v[0].sum(), np.exp(2.0) + np.exp(1.6) + 1.0 + np.exp(-2.0), rtol=1e-6)
  # Padded query rows are not in the denominator.
  acc = metrics.knn_accuracy(
    q, [0, 0], BANK, BANK_LABELS, 2, k=3, temperature=0.5, ks=(1,), query_valid=np.array([True, False])
  )
  assert acc[1] == 1.0


def test_knn_chunking_is_exact():
  rng = np.random.default_rng(1)
  bank = metrics.l2_normalize(rng.normal(size=(50, 6)).astype(np.float32))
  labels = rng.integers(0, 5, 50)
  q = metrics.l2_normalize(rng.normal(size=(7, 6)).astype(np.float32))
  a = metrics.knn_votes(q, bank, labels, 5, k=20, chunk_size=3)
  b = metrics.knn_votes(q, bank, labels, 5, k=20, chunk_size=100)
  np.testing.assert_allclose(a, b, rtol=1e-6)


# ------------------------------------------------------------------------------------------ templates
def test_templates():
  assert len(templates.IMAGENET80) == 80 and len(set(templates.IMAGENET80)) == 80
  assert len(templates.TCL9) == 9
  assert templates.get_templates("tcl") == templates.TCL9
  assert templates.get_templates(None, "shapes") == templates.SHAPES
  assert templates.get_templates(["a {} here"]) == ("a {} here",)
  with pytest.raises(ValueError):
    templates.get_templates(["no slot"])
  assert templates.fill(("a {}.", "the {}!"), ["x", "y"]) == ["a x.", "the x!", "a y.", "the y!"]
