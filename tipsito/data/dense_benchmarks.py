"""Readers of the dense benchmarks' published on-disk layouts: ADE20K, Pascal VOC 2012, Pascal Context, NYUv2.

Why readers and not converters: these datasets are evaluated (probes, tipsito/evals/probes.py), never
trained on, and each is a folder of image files plus label files that a user already has; reading them
where they lie needs no second copy. Nothing is downloaded: `open_split(name, split, root)` reads the
folder `root` and a missing file or folder is one error naming the layout expected (`LAYOUTS`).

A split is a random-access sequence of records in the field names of tipsito's own datasets (what
tipsito/data/eval_input.py reads): 'image' (encoded bytes of the image file), 'segmentation' (encoded
PNG label map) or 'depth' (encoded 16-bit PNG, millimetres), and 'id' (the file stem). Files are read
when a record is asked for, in sorted file order.

Label conventions (`BENCHMARKS`, applied by the evaluators through `MaskSpec`):
- ade20k: `annotations/*.png` hold 0 = "other" (ignored) and 1..150; scored as 150 classes after
  `reduce_zero_label` (v -> v - 1, 0 -> 255), mmseg's ADE20KDataset convention.
- voc2012: `SegmentationClass/*.png` are palette PNGs whose indices are 0 = background, 1..20, 255 =
  object border (ignored); 21 classes scored.
- pascal_context: the 59-class version in mmseg's layout (`SegmentationClassContext/*.png`, made by the
  Detail API's conversion): 0 = background (ignored), 1..59; 59 classes after `reduce_zero_label`.
- nyuv2: the BTS layout used by dinov2's depth probes: `sync_depth_*.png` uint16 millimetres next to
  `rgb_*.jpg` (0 = no depth); depth is scored between 1 mm and 10 m.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One dense benchmark: its layout, its splits, and how its labels are scored.

  kind: 'segmentation' | 'depth'; layout: the expected folders (printed in errors); splits: split name
  -> the split's folder or list file inside the root; num_classes / reduce_zero_label / ignore_index:
  the label rule (segmentation); min_depth / max_depth in metres (depth; GT outside is not scored).
  """

  name: str
  kind: str
  layout: str
  splits: Mapping[str, str]
  num_classes: int = 0
  reduce_zero_label: bool = False
  ignore_index: int = 255
  min_depth: float = 1e-3
  max_depth: float = 10.0


BENCHMARKS: dict[str, Benchmark] = {
  "ade20k": Benchmark(
    name="ade20k",
    kind="segmentation",
    layout=(
      "ROOT/ADEChallengeData2016/images/{training,validation}/ADE_*.jpg and "
      "ROOT/ADEChallengeData2016/annotations/{training,validation}/ADE_*.png (ROOT may also be the "
      "ADEChallengeData2016 folder itself)"
    ),
    splits={"train": "training", "validation": "validation"},
    num_classes=150,
    reduce_zero_label=True,
  ),
  "voc2012": Benchmark(
    name="voc2012",
    kind="segmentation",
    layout=(
      "ROOT/VOCdevkit/VOC2012/{JPEGImages/*.jpg, SegmentationClass/*.png, "
      "ImageSets/Segmentation/{train,val}.txt} (ROOT may also be VOCdevkit or VOC2012)"
    ),
    splits={"train": "train", "validation": "val"},
    num_classes=21,
  ),
  "pascal_context": Benchmark(
    name="pascal_context",
    kind="segmentation",
    layout=(
      "ROOT/VOCdevkit/VOC2010/{JPEGImages/*.jpg, SegmentationClassContext/*.png, "
      "ImageSets/SegmentationContext/{train,val}.txt} (mmseg's layout; ROOT may also be VOCdevkit or VOC2010)"
    ),
    splits={"train": "train", "validation": "val"},
    num_classes=59,
    reduce_zero_label=True,
  ),
  "nyuv2": Benchmark(
    name="nyuv2",
    kind="depth",
    layout=(
      "ROOT/sync/<scene>/{rgb_N.jpg, sync_depth_N.png} (train) and "
      "ROOT/official_splits/test/<scene>/{rgb_N.jpg, sync_depth_N.png} (test); depth uint16 millimetres"
    ),
    splits={"train": "sync", "test": "official_splits/test"},
  ),
}


class LayoutError(FileNotFoundError):
  """A dense benchmark's folder is missing or not in its published layout."""


def benchmark(name: str | None) -> Benchmark | None:
  """The `Benchmark` of a dataset name, or None for other datasets."""
  return BENCHMARKS.get(str(name)) if name else None


class FileRecords(Sequence):
  """Random-access records read from (image file, target file) pairs; files are read on access."""

  def __init__(self, pairs: Sequence[tuple[str, str, str]], target_key: str):
    self._pairs = list(pairs)
    self._target_key = target_key

  def __len__(self) -> int:
    return len(self._pairs)

  def __getitem__(self, i):
    stem, image_path, target_path = self._pairs[i]
    with open(image_path, "rb") as f:
      image = f.read()
    with open(target_path, "rb") as f:
      target = f.read()
    return {"image": image, self._target_key: target, "id": stem}


def _missing(bench: Benchmark, root: str, what: str) -> LayoutError:
  """The one error of a missing path: what is missing and the layout expected."""
  return LayoutError(
    f"{bench.name}: {what} not found under {root!r}; expected the published layout {bench.layout}. "
    "Evaluations never download: point the eval's data_dir at a local copy."
  )


def _find_dir(root: str, candidates: Sequence[str], bench: Benchmark) -> str:
  """The first existing folder among root/<candidate> (the root may be given at several depths)."""
  for c in candidates:
    path = os.path.join(root, c) if c else root
    if os.path.isdir(path):
      return path
  raise _missing(bench, root, f"folder {candidates[0]!r}")


def _pairs_from_list(bench, root, base, list_file, image_dir, target_dir, image_ext=".jpg"):
  """(stem, image, target) for every stem listed in `list_file` (VOC-style ImageSets)."""
  if not os.path.isfile(list_file):
    raise _missing(bench, root, f"split list {os.path.relpath(list_file, base)!r}")
  with open(list_file) as f:
    stems = [line.strip().split()[0] for line in f if line.strip()]
  pairs = []
  for stem in stems:
    image = os.path.join(base, image_dir, stem + image_ext)
    target = os.path.join(base, target_dir, stem + ".png")
    for path in (image, target):
      if not os.path.isfile(path):
        raise _missing(bench, root, f"file {os.path.relpath(path, base)!r} (listed in {list_file!r})")
    pairs.append((stem, image, target))
  return pairs


def _ade20k(bench: Benchmark, root: str, split: str):
  base = _find_dir(root, ("ADEChallengeData2016", ""), bench)
  images_dir = os.path.join(base, "images", bench.splits[split])
  targets_dir = os.path.join(base, "annotations", bench.splits[split])
  for d in (images_dir, targets_dir):
    if not os.path.isdir(d):
      raise _missing(bench, root, f"folder {os.path.relpath(d, root)!r}")
  pairs = []
  for image in sorted(glob.glob(os.path.join(images_dir, "*.jpg"))):
    stem = os.path.splitext(os.path.basename(image))[0]
    target = os.path.join(targets_dir, stem + ".png")
    if not os.path.isfile(target):
      raise _missing(bench, root, f"annotation {os.path.relpath(target, root)!r} of {stem}")
    pairs.append((stem, image, target))
  return pairs


def _voc(bench: Benchmark, root: str, split: str, year: str, target_dir: str, list_dir: str):
  base = _find_dir(root, (os.path.join("VOCdevkit", year), year, ""), bench)
  list_file = os.path.join(base, "ImageSets", list_dir, bench.splits[split] + ".txt")
  return _pairs_from_list(bench, root, base, list_file, "JPEGImages", target_dir)


def _nyuv2(bench: Benchmark, root: str, split: str):
  base = os.path.join(root, bench.splits[split])
  if not os.path.isdir(base):
    raise _missing(bench, root, f"folder {bench.splits[split]!r}")
  pairs = []
  for image in sorted(glob.glob(os.path.join(base, "*", "rgb_*.jpg"))):
    folder, file = os.path.split(image)
    number = file[len("rgb_") : -len(".jpg")]
    target = os.path.join(folder, f"sync_depth_{number}.png")
    if not os.path.isfile(target):
      raise _missing(bench, root, f"depth map {os.path.relpath(target, root)!r}")
    pairs.append((f"{os.path.basename(folder)}/{number}", image, target))
  return pairs


def open_split(name: str, split: str, root: str | None) -> FileRecords:
  """The records of `split` of the benchmark `name` read from the folder `root` (see the module doc)."""
  bench = BENCHMARKS.get(name)
  if bench is None:
    raise KeyError(f"unknown dense benchmark {name!r}; known: {sorted(BENCHMARKS)}")
  if split not in bench.splits:
    raise KeyError(f"{name}: unknown split {split!r}; known: {sorted(bench.splits)}")
  if not root or not os.path.isdir(root):
    raise _missing(bench, str(root), "the dataset folder (data_dir)")
  if name == "ade20k":
    pairs = _ade20k(bench, root, split)
  elif name == "voc2012":
    pairs = _voc(bench, root, split, "VOC2012", "SegmentationClass", "Segmentation")
  elif name == "pascal_context":
    pairs = _voc(bench, root, split, "VOC2010", "SegmentationClassContext", "SegmentationContext")
  else:
    pairs = _nyuv2(bench, root, split)
  if not pairs:
    raise _missing(bench, root, f"any example of split {split!r}")
  return FileRecords(pairs, "depth" if bench.kind == "depth" else "segmentation")
