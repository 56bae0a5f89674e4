"""Trains the shipped demo SentencePiece (BPE) model: `python -m tipsito.data.train_tokenizer [--output F]`.

Why offline and shipped: tests and the CPU demo must tokenize without downloads; a small vocabulary
(default 2000) keeps the demo text embedding table small. The corpus is the captions of the demo
datasets: procedural `shapes` captions (all three fields), the Tux Paint stamp captions and
synthetic captions (when the Debian package is installed), and the Fashion-MNIST templates, plus a
few generic words of contrastive prompts ("a photo of a ..."). Text is lower-cased (as the
Tokenizer does). Special ids: pad=0, unk=1, no BOS/EOS (contract).

`--corpus scenes` trains the scene testbed's model instead (`SCENES_TOKENIZER`, 'scenes_sp.model' beside
the demo model): the captions of `scenes` (all three fields) and its eval prompts only, with a small
vocabulary, so that every class word is one whole piece and every caption fits a 32-token `max_len`
(tests/test_data_builders_scenes.py checks both).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from tipsito.data.builders import fashion_mnist
from tipsito.data.builders import scenes_gen
from tipsito.data.builders import shapes_gen
from tipsito.data.builders import tuxpaint
from tipsito.data.tokenizer import ASSETS_DIR
from tipsito.data.tokenizer import DEFAULT_TOKENIZER

SCENES_TOKENIZER = os.path.join(ASSETS_DIR, "scenes_sp.model")

_PROMPTS = [
  "a photo of a {}.",
  "a picture of a {}.",
  "an image of a {}.",
  "a drawing of a {}.",
  "a close-up photo of the {}.",
  "a bad photo of a {}.",
  "a good photo of the {}.",
  "a rendering of a {}.",
  "a cropped photo of the {}.",
  "a bright photo of a {}.",
  "a dark photo of the {}.",
  "a blurry photo of a {}.",
]


def demo_corpus(num_shapes: int = 3000) -> list[str]:
  """Lower-cased caption sentences of the demo datasets (deterministic)."""
  lines = []
  for i in range(num_shapes):
    ex = shapes_gen.generate(i, split="train", image_size=32)
    lines += [ex["alt_text"], ex["caption_detailed"], ex["caption_gemini"]]
  for label in range(len(fashion_mnist.CLASS_NAMES)):
    lines += list(fashion_mnist.captions_for(label).values())
  names = list(shapes_gen.SHAPE_CLASSES) + list(fashion_mnist.CLASS_NAMES)
  try:
    stamps = tuxpaint.find_stamps()
    for png, _category in stamps:
      cap = tuxpaint.read_caption(png[:-4] + ".txt")
      if cap:
        lines.append(cap)
    names += list(tuxpaint.CATEGORY_WORDS.values())
    lines += [f"a picture of a {w}" for w in tuxpaint.CATEGORY_WORDS.values()]
  except (ImportError, OSError) as e:  # package not installed: shapes + fashion only
    print(f"tuxpaint captions skipped: {e}", file=sys.stderr)
  for name in names:
    lines += [p.format(name) for p in _PROMPTS]
  return [line.lower() for line in lines if line.strip()]


def scenes_corpus(num_scenes: int = 3000) -> list[str]:
  """Lower-cased captions of `scenes` train examples (all three fields) and the scenes eval prompts."""
  lines = []
  for i in range(num_scenes):
    ex = scenes_gen.generate(i, split="train", image_size=32)
    lines += [ex["alt_text"], ex["caption"], ex["caption_detailed"]]
  for name in scenes_gen.CLASSES + ("background",):
    lines += [p.format(name) for p in scenes_gen.PROMPTS]
  return [line.lower() for line in lines if line.strip()]


def train(
  output: str = DEFAULT_TOKENIZER,
  vocab_size: int = 2000,
  num_shapes: int = 3000,
  model_type: str = "bpe",
  corpus: str = "demo",
) -> str:
  """Trains a (BPE by default: the small corpus caps unigram vocabularies at ~700) model on `demo_corpus()`
  (or `scenes_corpus()` when corpus='scenes', `num_shapes` scenes) and writes it to `output`; returns the path."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  if corpus not in ("demo", "scenes"):
    raise ValueError(f"--corpus {corpus!r}: valid values are 'demo' and 'scenes'")
  corpus = demo_corpus(num_shapes) if corpus == "demo" else scenes_corpus(num_shapes)
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    txt = os.path.join(tmp, "corpus.txt")
    with open(txt, "w", encoding="utf-8") as f:
      f.write("\n".join(corpus) + "\n")
    prefix = os.path.join(tmp, "sp")
    spm.SentencePieceTrainer.train(
      input=txt,
      model_prefix=prefix,
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=1.0,
      pad_id=0,
      unk_id=1,
      bos_id=-1,
      eos_id=-1,
      hard_vocab_limit=False,
      normalization_rule_name="nmt_nfkc",
      shuffle_input_sentence=False,
      num_threads=2,
      minloglevel=2,
    )
    with open(prefix + ".model", "rb") as src, open(output, "wb") as dst:
      dst.write(src.read())
  return output


def main(argv=None) -> None:
  """CLI: --corpus demo|scenes --output PATH --vocab_size N --num_shapes N."""
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--corpus", choices=("demo", "scenes"), default="demo")
  p.add_argument("--output", help=f"default: {DEFAULT_TOKENIZER} (demo) or {SCENES_TOKENIZER} (scenes)")
  p.add_argument("--vocab_size", type=int, help="default: 2000 (demo) or 128 (scenes)")
  p.add_argument("--num_shapes", type=int, default=3000, help="examples of shapes (demo) or scenes")
  a = p.parse_args(argv)
  scenes = a.corpus == "scenes"
  output = a.output or (SCENES_TOKENIZER if scenes else DEFAULT_TOKENIZER)
  vocab_size = a.vocab_size or (128 if scenes else 2000)
  path = train(output, vocab_size, a.num_shapes, corpus=a.corpus)
  print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
  main()
