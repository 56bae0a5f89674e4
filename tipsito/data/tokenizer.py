"""SentencePiece text tokenizer with the contract's conventions (pad id 0, fixed length), per text flavour.

Why a wrapper: the text encoder derives its attention mask from `ids != 0`, so id 0 must be padding
and nothing else; captions are lower-cased (the paper's tokenization; also halves the vocabulary a
small demo model needs); every batch has the same (B, max_len) int32 shape so XLA compiles once.

The shipped demo model (`DEFAULT_TOKENIZER`, trained by `tipsito/data/train_tokenizer.py`) reserves
pad=0, unk=1 and has no BOS/EOS pieces, so real pieces are ids >= 2. Any other SentencePiece model
can be configured. Its ids are used exactly as SentencePiece returns them, because that is what the
official TIPS tokenizer does and released text weights are indexed by those ids (a model whose unk is 0
then shares id 0 with padding, as in the official code). For a stock model trained from scratch,
`shift_ids=True` moves every piece up by one so that 0 stays free for padding (`vocab_size` grows by
one accordingly).

Two flavours, the text tower's (`config.model.text.flavour`, tipsito/models/text.py):
  * 'tips': the official TIPS tokenization: pieces only, no BOS/EOS, truncated to max_len.
  * 'clip': OpenCLIP's layout, [SOT, pieces..., EOT], truncated to max_len with EOT kept as the last
    token (OpenCLIP's tokenizer and Hugging Face's CLIPTokenizer do the same), so the tower pools the
    EOT. SOT and EOT are two ids reserved on top of the model's id space, SOT = n and EOT = n + 1 for
    an id space of n (`vocab_size` = n + 2), whether or not the model has its own bos/eos pieces
    (those are never emitted). Why at the top: OpenCLIP pools `text.argmax(-1)`, i.e. it takes EOT to
    be the largest id, as in its BPE vocabulary (49406 = SOT, 49407 = EOT, 49408 ids), and Hugging
    Face pools the first `eos_token_id`; with EOT = vocab_size - 1 both pick the position tipsito's
    tower pools, for every SentencePiece model.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEFAULT_TOKENIZER = os.path.join(ASSETS_DIR, "demo_sp.model")
PAD_ID = 0
FLAVOURS = ("tips", "clip")  # the text tower's (tipsito.models.text.FLAVOURS)


class Tokenizer:
  """`Tokenizer(model_path=None, max_len=64, lowercase=True, flavour='tips')`; None = the demo model.

  `tokenize(texts) -> np.int32 (B, max_len)`: lower-cased, truncated to max_len, padded with 0; no
  BOS/EOS ('tips') or [SOT, ..., EOT] with EOT kept ('clip'). `detokenize(ids) -> list[str]` ignores
  padding and SOT/EOT. `vocab_size` is the embedding table size the text encoder needs (all ids are
  < vocab_size); `sot_id` / `eot_id` are None for 'tips'.
  """

  def __init__(
    self,
    model_path: str | None = None,
    max_len: int = 64,
    lowercase: bool = True,
    shift_ids: bool = False,
    flavour: str = "tips",
  ):
    """Loads the model; FileNotFoundError names the configured path.

    shift_ids: add 1 to every id of a model whose own pad id is not 0 (see the module docstring);
      off by default so that ids match the official TIPS tokenizer and released weights.
    flavour: 'tips' (no special tokens) or 'clip' (SOT/EOT on top of the id space; see the module
      docstring); the text tower's flavour.
    """
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top

    from etils import epath  # pylint: disable=g-import-not-at-top  (gs:// model files too)

    path = os.path.expanduser(os.fspath(model_path)) if model_path else DEFAULT_TOKENIZER
    if not epath.Path(path).is_file():
      raise FileNotFoundError(
        f"tokenizer model {path!r} not found (config.tokenizer); use None for the shipped demo model "
        f"{DEFAULT_TOKENIZER!r} or train one with `python -m tipsito.data.train_tokenizer`"
      )
    if max_len <= 0:
      raise ValueError(f"max_len must be positive, got {max_len}")
    if flavour not in FLAVOURS:
      raise ValueError(f"tokenizer flavour {flavour!r} unknown; valid values: {list(FLAVOURS)}")
    if flavour == "clip" and max_len < 2:
      raise ValueError(f"the 'clip' flavour needs max_len >= 2 (SOT and EOT), got {max_len}")
    self.flavour = flavour
    self.model_path = path
    self.max_len = int(max_len)
    self.lowercase = lowercase
    self._sp = spm.SentencePieceProcessor(model_proto=epath.Path(path).read_bytes())
    # Offset so that no real piece lands on 0: none needed when the model's own pad is 0.
    self.shift_ids = bool(shift_ids)
    self._offset = 1 if (shift_ids and self._sp.pad_id() != PAD_ID) else 0
    self._bos, self._eos = self._sp.bos_id(), self._sp.eos_id()
    n = self._sp.get_piece_size() + self._offset
    self.sot_id, self.eot_id = (n, n + 1) if flavour == "clip" else (None, None)

  @property
  def vocab_size(self) -> int:
    """Size of the id space (max id + 1), including the pad id 0 and, for 'clip', SOT and EOT."""
    return self._sp.get_piece_size() + self._offset + (2 if self.flavour == "clip" else 0)

  def __getstate__(self):
    """Pickles by path (grain workers rebuild the SentencePiece processor)."""
    return {
      "model_path": self.model_path,
      "max_len": self.max_len,
      "lowercase": self.lowercase,
      "shift_ids": self.shift_ids,
      "flavour": self.flavour,
    }

  def __setstate__(self, state):
    """Rebuilds from the pickled path/max_len/lowercase/shift_ids/flavour."""
    self.__init__(**state)

  def encode(self, text: str) -> list[int]:
    """Piece ids of one text (no padding, no truncation, no BOS/EOS/SOT/EOT)."""
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    text = text.lower() if self.lowercase else text
    ids = self._sp.encode(text, out_type=int)
    if self._offset or self._bos >= 0 or self._eos >= 0:
      ids = [i + self._offset for i in ids if i not in (self._bos, self._eos)]
    return ids

  def tokenize(self, texts: str | Sequence[str] | Iterable[str]) -> np.ndarray:
    """(B, max_len) int32 ids, 0-padded and truncated; a single string gives B = 1."""
    if isinstance(texts, (str, bytes)):
      texts = [texts]
    texts = list(texts)
    out = np.zeros((len(texts), self.max_len), np.int32)
    for row, text in enumerate(texts):
      if self.flavour == "clip":
        ids = [self.sot_id] + self.encode(text)[: self.max_len - 2] + [self.eot_id]
      else:
        ids = self.encode(text)[: self.max_len]
      out[row, : len(ids)] = ids
    return out

  __call__ = tokenize

  def detokenize(self, ids: np.ndarray | Sequence[Sequence[int]]) -> list[str]:
    """Texts of a (B, L) id array; padding (0) and SOT/EOT are dropped."""
    arr = np.asarray(ids)
    if arr.ndim == 1:
      arr = arr[None]
    out = []
    skip = {PAD_ID, self.sot_id, self.eot_id}
    for row in arr:
      pieces = [int(i) - self._offset for i in row if int(i) not in skip]
      out.append(self._sp.decode([p for p in pieces if 0 <= p < self._sp.get_piece_size()]))
    return out

  def __repr__(self) -> str:
    """Model path, max_len and vocab size, for logs."""
    return (
      f"Tokenizer({self.model_path!r}, max_len={self.max_len}, flavour={self.flavour!r}, "
      f"vocab_size={self.vocab_size})"
    )


def from_config(config) -> Tokenizer:
  """The tokenizer a training config's text tower reads: `config.tokenizer` (None = the demo model),
  `config.max_len` and the flavour of `config.model.text`.

  Why one constructor: the data pipeline, the vocabulary check, the text tower's vocab_size and the
  training-time evals must tokenize the same way, and for 'clip' the reserved SOT/EOT ids change the
  vocabulary size.
  """
  return Tokenizer(config.tokenizer, max_len=int(config.max_len), flavour=config.model.text.flavour)
