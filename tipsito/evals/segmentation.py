"""Zero-shot semantic segmentation from value embeddings (the TIPS / TIPSv2 protocol).

Why this protocol: it measures dense patch-text alignment, the property TIPSv2's iBOT++ targets. Patch
features are the *value embeddings* of the last block (MaskCLIP trick, `embed_images(...)['values']`,
with the export's projection when `project`), L2-normalised and compared by cosine with per-class text
embeddings averaged over TCL's 9 templates. Cosine maps are upsampled bilinearly to the image size and
the arg-max class is the prediction; mIoU is computed from a confusion matrix accumulated over the whole
split (ignore label 255; classes absent from both GT and prediction are excluded).

Protocols:
- 'whole' (TIPSv2 default): the image resized to `image_size` is encoded once.
- 'slide' (TCL): the image at `image_size` is covered by `crop_size` windows with `stride`; window cosine
  maps (upsampled to the window) are summed and divided by the per-pixel window count.

Background: if `background_index` is set and `bg_threshold` is None, the background class is prompted
like any other class with `background_name`; with a `bg_threshold` (PC60-style) it is not prompted and a
pixel is background when its best foreground cosine is below the threshold.

Class names: `class_names` (index = GT value) or the dataset's ClassLabel names with `background_name`
inserted at `background_index` (tipsito builders: mask value = class + 1, 0 = background).
GT masks: the record's segmentation field, or the alpha channel (`mask_source='alpha'`: foreground =
alpha >= 128, labelled label+1 when `alpha_label='label'`, else 1). `reduce_zero_label` maps 0 -> 255 and
v -> v-1 (ADE20K convention). GT is resized with nearest neighbour together with the image, and metrics
are computed at the eval resolution. The GT maps are read by `tipsito.data.eval_input` (`MaskSpec`).

Config keys (besides evaluator.COMMON_DEFAULTS): protocol ('whole'), crop_size (None), stride (None =
crop_size * 2 // 3), background_index (0), background_name ('background'), bg_threshold (None),
ignore_index (255), reduce_zero_label (False), mask_source ('auto'), alpha_label ('label'),
templates (None = 'tcl'), resize ('resize').
Metrics: '<name>/miou', '<name>/pixel_acc', '<name>/mean_acc' (percent), '<name>/num_examples',
'<name>/num_classes'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tipsito.data import eval_input
from tipsito.evals import evaluator
from tipsito.evals import metrics as metrics_lib
from tipsito.evals import pictures as pictures_lib


@functools.partial(jax.jit, static_argnames=("out_hw",))
def dense_cosine(values, class_emb, out_hw: tuple[int, int]):
  """(B,h,w,D) value features x (C,D) normalised class embeddings -> (B,H,W,C) upsampled cosines.

  Bilinear upsampling of the cosine maps (not of the features), as in TCL / the TIPS notebook; one
  image at a time (lax.map) keeps memory at H*W*C per step.
  """
  v = values / jnp.maximum(jnp.linalg.norm(values, axis=-1, keepdims=True), 1e-12)

  def one(vi):
    cos = jnp.einsum("hwd,cd->hwc", vi, class_emb)
    return jax.image.resize(cos, (out_hw[0], out_hw[1], cos.shape[-1]), method="bilinear")

  return jax.lax.map(one, v)


@jax.jit
def predict_from_cosine(cos, prompted, bg_index, bg_threshold):
  """Arg-max over prompted classes; pixels whose best cosine < bg_threshold become bg_index.

  `prompted` (C,) bool marks classes with a text embedding; `bg_threshold` = -inf disables the
  threshold. Returns int32 labels (..., H, W).
  """
  masked = jnp.where(prompted, cos, -jnp.inf)
  pred = jnp.argmax(masked, axis=-1).astype(jnp.int32)
  best = jnp.max(masked, axis=-1)
  return jnp.where(best < bg_threshold, bg_index, pred)


def window_positions(size: int, crop: int, stride: int) -> list[int]:
  """Start offsets of sliding windows covering [0, size) (last window flush with the border; mmseg)."""
  if crop >= size:
    return [0]
  n = (size - crop + stride - 1) // stride + 1
  return sorted({min(i * stride, size - crop) for i in range(n)})


class SegmentationEvaluator(evaluator.Evaluator):
  """mIoU of zero-shot segmentation by value-embedding / text cosine."""

  TYPE = "segmentation"
  NEEDS_MASKS = True
  DEFAULTS = dict(protocol="whole", crop_size=None, stride=None, background_index=0,
                  background_name="background", bg_threshold=None, ignore_index=255,
                  reduce_zero_label=False, mask_source="auto", alpha_label="label", resize="resize")

  # ------------------------------------------------------------------ classes and prompts
  def seg_class_names(self) -> list[str]:
    """Class names indexed by GT value (see module docstring)."""
    if self.cfg.get("class_names"):
      return [str(c) for c in self.cfg["class_names"]]
    names = list(self.class_names())
    bg = self.cfg.get("background_index")
    if bg is not None:
      names.insert(int(bg), str(self.cfg["background_name"]))
    return names

  def _class_embeddings(self, encoder, names):
    """(C, D) normalised class embeddings and the (C,) mask of prompted classes."""
    bg = self.cfg.get("background_index")
    thr = self.cfg.get("bg_threshold")
    prompted = np.ones(len(names), bool)
    if bg is not None and thr is not None:
      prompted[int(bg)] = False
    emb_prompted = self.class_text_embeddings(encoder, [n for n, p in zip(names, prompted) if p],
                                              self.templates("tcl"))
    emb = np.zeros((len(names), emb_prompted.shape[1]), np.float32)
    emb[prompted] = emb_prompted
    return emb, prompted

  # ------------------------------------------------------------------ GT masks
  def mask_spec(self) -> eval_input.MaskSpec:
    """GT label maps from the segmentation field or from alpha (see the module docstring)."""
    cfg = self.cfg
    return eval_input.MaskSpec(
        source=cfg["mask_source"], key=cfg["segmentation_key"],
        alpha_label_key=cfg["label_key"] if cfg["alpha_label"] == "label" else None,
        reduce_zero_label=bool(cfg["reduce_zero_label"]), ignore_index=int(cfg["ignore_index"]))

  # ------------------------------------------------------------------ dense cosines
  def _values(self, encoder, images: np.ndarray):
    """One fixed-size batch through the image tower with value embeddings: (outputs, values)."""
    out = self.embed_images(encoder, images, need_values=True)
    return out, out["values"]

  def _cosines_whole(self, encoder, batch, class_emb):
    """'whole' protocol: one pass per image, cosine maps upsampled to the image size."""
    out, values = self._values(encoder, batch["image"])
    hw = tuple(batch["image"].shape[1:3])
    return out, dense_cosine(jnp.asarray(values), jnp.asarray(class_emb), hw)

  def _cosines_slide(self, encoder, batch, class_emb):
    """'slide' protocol (TCL): windows of crop_size with stride, encoded in fixed batches of
    batch_size crops (valid images only); per-window cosine maps are summed and averaged per pixel."""
    images = batch["image"]
    b, h, w = images.shape[:3]
    crop = int(self.cfg.get("crop_size") or min(h, w))
    stride = int(self.cfg.get("stride") or max(1, crop * 2 // 3))
    ys, xs = window_positions(h, crop, stride), window_positions(w, crop, stride)
    wins = [(y, x) for y in ys for x in xs]
    valid_idx = np.nonzero(batch["_valid"])[0]  # padded images are not encoded at all
    crops = np.stack([images[valid_idx, y:y + crop, x:x + crop] for y, x in wins], 1)  # (V, n, c, c, 3)
    flat = crops.reshape((-1,) + crops.shape[2:])
    bs = int(self.cfg["batch_size"])
    cos_parts = []
    for s in range(0, flat.shape[0], bs):
      chunk = flat[s:s + bs]
      n = chunk.shape[0]
      if n < bs:
        chunk = np.concatenate([chunk, np.zeros((bs - n,) + chunk.shape[1:], chunk.dtype)], 0)
      _, values = self._values(encoder, chunk)
      cos_parts.append(np.asarray(dense_cosine(jnp.asarray(values), jnp.asarray(class_emb),
                                               (crop, crop)))[:n])
    cos_w = np.concatenate(cos_parts, 0).reshape(len(valid_idx), len(wins), crop, crop, -1)
    total = np.zeros((b, h, w, cos_w.shape[-1]), np.float32)
    count = np.zeros((1, h, w, 1), np.float32)
    for i, (y, x) in enumerate(wins):
      total[valid_idx, y:y + crop, x:x + crop] += cos_w[:, i]
      count[:, y:y + crop, x:x + crop] += 1.0
    return None, jnp.asarray(total / np.maximum(count, 1.0))

  # ------------------------------------------------------------------ run
  def run(self, encoder) -> dict[str, float]:
    """Predicts every eval image, accumulates one confusion matrix, returns mIoU etc."""
    self.pictures = {}
    names = self.seg_class_names()
    num_classes = len(names)
    class_emb, prompted = self._class_embeddings(encoder, names)
    bg = self.cfg.get("background_index")
    thr = self.cfg.get("bg_threshold")
    bg_index = jnp.int32(int(bg) if bg is not None else 0)
    bg_thr = jnp.float32(float(thr) if (thr is not None and bg is not None) else -np.inf)
    cm = metrics_lib.ConfusionMatrix(num_classes, int(self.cfg["ignore_index"]))
    protocol = self.cfg["protocol"]
    n_pics = int(self.cfg.get("num_pictures") or 0)
    overlays = []
    n = 0
    for batch in self.batches(need_mask=True):
      if protocol == "whole":
        out, cos = self._cosines_whole(encoder, batch, class_emb)
      elif protocol == "slide":
        out, cos = self._cosines_slide(encoder, batch, class_emb)
        if n_pics and self.key("pca") not in self.pictures:
          out = self.embed_images(encoder, batch["image"])  # whole-image pass for the PCA picture
      else:
        raise ValueError(f"unknown protocol {protocol!r} (use 'whole' or 'slide')")
      pred = np.asarray(predict_from_cosine(cos, jnp.asarray(prompted), bg_index, bg_thr))
      valid = batch["_valid"]
      cm.update(pred, batch["segmentation"], valid)
      n += int(valid.sum())
      if out is not None:
        self._collect_pca(out, batch)
      for i in np.nonzero(valid)[0]:
        if len(overlays) >= n_pics:
          break
        overlays.append(pictures_lib.segmentation_overlay(batch["image"][i], pred[i],
                                                          batch["segmentation"][i], num_classes))
    if overlays:
      self.pictures[f"{self.name}/overlay"] = pictures_lib.stack_rows(overlays)
    r = cm.compute()
    self.last_iou = dict(zip(names, (float(x) for x in r["iou"])))
    self.last_confusion = cm.matrix
    return {
        self.key("miou"): evaluator.pct(r["miou"]),
        self.key("pixel_acc"): evaluator.pct(r["pixel_acc"]),
        self.key("mean_acc"): evaluator.pct(r["mean_acc"]),
        self.key("num_examples"): float(n),
        self.key("num_classes"): float(num_classes),
    }
