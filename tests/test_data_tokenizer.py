"""SentencePiece tokenizer wrapper: contract conventions (pad 0, no BOS/EOS, lowercase, max_len).

Why: the text encoder's validity mask is `ids != 0`; any id-0 collision or BOS/EOS token would
change what the text tower sees, and a shape change would trigger recompiles.
"""
import os
import pickle

import numpy as np
import pytest

from tipsito.data import tokenizer as tok_lib


@pytest.fixture(scope="module")
def tok():
  """Shipped demo tokenizer, max_len 16."""
  return tok_lib.Tokenizer(max_len=16)


def test_shipped_model(tok):
  """The asset exists, is small and has a 1k-4k vocabulary."""
  assert os.path.isfile(tok_lib.DEFAULT_TOKENIZER)
  assert os.path.getsize(tok_lib.DEFAULT_TOKENIZER) < 1 << 20
  assert 1000 <= tok.vocab_size <= 4000
  assert tok.model_path == tok_lib.DEFAULT_TOKENIZER


def test_round_trip_and_lowercase(tok):
  """Detokenize(tokenize(x)) == lower(x); case does not change ids."""
  texts = ["a red circle", "A large blue star at the top left, on a plain white background.",
           "A US 25 cent piece called a quarter."]
  ids = tok.tokenize(texts)
  assert ids.dtype == np.int32 and ids.shape == (3, 16)
  assert tok.detokenize(ids[:2]) == [t.lower() for t in texts[:2]]
  np.testing.assert_array_equal(tok.tokenize(["A RED Circle"]), tok.tokenize(["a red circle"]))


def test_padding_truncation_and_no_special_tokens(tok):
  """Trailing 0 padding, exact truncation, no BOS/EOS."""
  ids = tok.tokenize(["a red circle", "", " ".join(["circle"] * 40)])
  n = int((ids[0] != 0).sum())
  assert n > 0 and (ids[0, :n] != 0).all() and (ids[0, n:] == 0).all()  # pads only at the end
  assert (ids[1] == 0).all()  # empty text: all padding
  assert (ids[2] != 0).all()  # truncated to exactly max_len
  full = tok.encode(" ".join(["circle"] * 40))
  assert len(full) > 16 and list(ids[2]) == full[:16]
  assert ids.min() >= 0 and ids.max() < tok.vocab_size
  first = tok.encode("a")[0]
  assert tok.tokenize(["a"])[0, 0] == first  # no BOS in front
  assert tok.tokenize("a").shape == (1, 16)


def test_no_real_piece_is_zero(tok):
  """Unknown text maps to unk (1), never to the pad id."""
  corpus = ["zebra 12345 !?", "日本語のテキスト", "ünïcödé", "\t\n", "a" * 200]
  ids = np.concatenate([tok.encode(t) for t in corpus])
  assert (ids != 0).all()


def test_missing_model_errors(tmp_path):
  """A configured model path that does not exist is named in the error."""
  with pytest.raises(FileNotFoundError, match="nope.model"):
    tok_lib.Tokenizer(str(tmp_path / "nope.model"))


def test_picklable(tok):
  """Pickles by path and tokenizes identically after."""
  clone = pickle.loads(pickle.dumps(tok))
  np.testing.assert_array_equal(clone.tokenize(["a star"]), tok.tokenize(["a star"]))


def test_model_with_other_pad_is_shifted_on_request(tmp_path):
  """A stock model (unk=0, bos/eos present, no pad): ids as SentencePiece gives them by default (the
  official TIPS convention released weights depend on), shifted by one with shift_ids=True."""
  import sentencepiece as spm
  corpus = tmp_path / "c.txt"
  corpus.write_text("\n".join(f"a red circle number {i} and a blue square" for i in range(200)))
  spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "m"), vocab_size=40,
                                 minloglevel=2)
  plain = tok_lib.Tokenizer(str(tmp_path / "m.model"), max_len=32)
  raw = plain._sp.encode("a red circle")
  assert list(plain.tokenize(["A red circle"])[0, : len(raw)]) == raw
  assert plain.vocab_size == plain._sp.get_piece_size()
  t = tok_lib.Tokenizer(str(tmp_path / "m.model"), max_len=32, shift_ids=True)
  ids = t.tokenize(["A red circle", "zzzz"])
  assert list(ids[0, : len(raw)]) == [i + 1 for i in raw]
  assert (ids[1] != 0).sum() > 0  # unknown pieces map to unk+1, not to padding
  assert t.vocab_size == t._sp.get_piece_size() + 1
  assert t.detokenize(ids[:1]) == ["a red circle"]
  assert pickle.loads(pickle.dumps(t)).tokenize(["a red circle"]).tolist() == ids[:1].tolist()
