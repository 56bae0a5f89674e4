"""Class-name lists of the zero-shot segmentation benchmarks TIPSv2 reports (Tables 1, 3, 4, 5).

Why a module of its own: a benchmark's number depends on the exact words prompted and on their order
(index = label value after the benchmark's label mapping, see `tipsito.evals.segmentation.BENCHMARKS`),
so the lists are data shipped with the package, not something a config retypes.

Sources (names copied as published, including their spellings):
- `ADE150`: the 150 ADE20K (SceneParse150) class names of the official TIPS zero-shot segmentation
  notebook ("TIPS_zeroshot_segmentation.ipynb" in the google-deepmind/tips repository), which are the
  first synonym of each mmsegmentation `ADE20KDataset` class. Label v in the annotation PNGs is class
  v - 1; 0 ("other") is not a class.
- `PC59` / `PC60`: PASCAL Context in mmsegmentation's 59-class layout (`PascalContextDataset59` /
  `PascalContextDataset`), the lists TCL evaluates with ("context59" / "context"). In the annotation PNGs
  of that layout 0 is background and v in 1..59 is `PC59[v - 1]`; `PC60` = ('background',) + `PC59`.
- `VOC21`: PASCAL VOC 2012 (mmsegmentation `PascalVOCDataset`, TCL's "voc"): 0 background, 1..20 the
  objects, 255 the void border. `VOC20` is the same without background (TCL's "voc20").
The mmsegmentation spellings are kept ('diningtable', 'pottedplant', 'tvmonitor', 'bedclothes'):
they are what TCL prompts, and changing a word changes the benchmark.
"""

from __future__ import annotations

ADE150 = (
    "wall", "building", "sky", "floor", "tree", "ceiling", "road", "bed", "windowpane", "grass",
    "cabinet", "sidewalk", "person", "earth", "door", "table", "mountain", "plant", "curtain", "chair",
    "car", "water", "painting", "sofa", "shelf", "house", "sea", "mirror", "rug", "field",
    "armchair", "seat", "fence", "desk", "rock", "wardrobe", "lamp", "bathtub", "railing", "cushion",
    "base", "box", "column", "signboard", "chest of drawers", "counter", "sand", "sink", "skyscraper",
    "fireplace",
    "refrigerator", "grandstand", "path", "stairs", "runway", "case", "pool table", "pillow",
    "screen door", "stairway",
    "river", "bridge", "bookcase", "blind", "coffee table", "toilet", "flower", "book", "hill", "bench",
    "countertop", "stove", "palm", "kitchen island", "computer", "swivel chair", "boat", "bar",
    "arcade machine", "hovel",
    "bus", "towel", "light", "truck", "tower", "chandelier", "awning", "streetlight", "booth",
    "television receiver",
    "airplane", "dirt track", "apparel", "pole", "land", "bannister", "escalator", "ottoman", "bottle",
    "buffet",
    "poster", "stage", "van", "ship", "fountain", "conveyer belt", "canopy", "washer", "plaything",
    "swimming pool",
    "stool", "barrel", "basket", "waterfall", "tent", "bag", "minibike", "cradle", "oven", "ball",
    "food", "step", "tank", "trade name", "microwave", "pot", "animal", "bicycle", "lake", "dishwasher",
    "screen", "blanket", "sculpture", "hood", "sconce", "vase", "traffic light", "tray", "ashcan", "fan",
    "pier", "crt screen", "plate", "monitor", "bulletin board", "shower", "radiator", "glass", "clock",
    "flag",
)

PC59 = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "table", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
    "bag", "bed", "bench", "book", "building", "cabinet", "ceiling", "cloth", "computer", "cup",
    "door", "fence", "floor", "flower", "food", "grass", "ground", "keyboard", "light", "mountain",
    "mouse", "curtain", "platform", "sign", "plate", "road", "rock", "shelves", "sidewalk", "sky",
    "snow", "bedclothes", "track", "tree", "truck", "wall", "water", "window", "wood",
)

PC60 = ("background",) + PC59

VOC20 = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
    "tvmonitor",
)

VOC21 = ("background",) + VOC20

LISTS: dict[str, tuple[str, ...]] = {
    "ade150": ADE150,
    "pc59": PC59,
    "pc60": PC60,
    "voc20": VOC20,
    "voc21": VOC21,
}
