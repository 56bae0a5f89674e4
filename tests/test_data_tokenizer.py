"""SentencePiece tokenizer wrapper: contract conventions (pad 0, lowercase, max_len; no BOS/EOS for the
TIPS flavour, OpenCLIP's SOT/EOT for the clip flavour).

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
  texts = [
    "a red circle",
    "A large blue star at the top left, on a plain white background.",
    "A US 25 cent piece called a quarter.",
  ]
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
  spm.SentencePieceTrainer.train(
    input=str(corpus), model_prefix=str(tmp_path / "m"), vocab_size=40, minloglevel=2
  )
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


@pytest.fixture(scope="module")
def clip_tok():
  """Shipped demo tokenizer, 'clip' flavour (OpenCLIP's SOT/EOT layout), max_len 16."""
  return tok_lib.Tokenizer(max_len=16, flavour="clip")


def test_clip_flavour_sot_pieces_eot(tok, clip_tok):
  """'clip': [SOT, pieces, EOT, 0...] as OpenCLIP's tokenizer writes, with SOT/EOT the two ids on top of
  the model's id space (EOT the largest id, what OpenCLIP's argmax pooling assumes)."""
  n = tok.vocab_size  # the demo model's own ids (2000, no bos/eos pieces)
  assert (clip_tok.sot_id, clip_tok.eot_id, clip_tok.vocab_size) == (n, n + 1, n + 2)
  assert tok.sot_id is None and tok.eot_id is None and tok.vocab_size == n
  pieces = tok.encode("a red circle")
  ids = clip_tok.tokenize(["A red circle", ""])
  assert ids.dtype == np.int32 and ids.shape == (2, 16)
  assert list(ids[0, : len(pieces) + 2]) == [n] + pieces + [n + 1]
  assert (ids[0, len(pieces) + 2 :] == 0).all()
  assert list(ids[1, :2]) == [n, n + 1] and (ids[1, 2:] == 0).all()  # empty text: SOT, EOT
  assert (ids.argmax(-1) == (ids != 0).sum(-1) - 1).all()  # EOT = argmax = last valid token
  assert clip_tok.detokenize(ids) == ["a red circle", ""]


def test_clip_flavour_truncation_keeps_eot(tok, clip_tok):
  """Longer than max_len: SOT + the first max_len - 2 pieces + EOT (OpenCLIP: tokens[:L], tokens[-1] = EOT)."""
  text = " ".join(["circle"] * 40)
  full = tok.encode(text)
  row = clip_tok.tokenize(text)[0]
  assert list(row) == [clip_tok.sot_id] + full[:14] + [clip_tok.eot_id]
  # TIPS flavour of the same text is unchanged: the first max_len pieces, no special ids.
  assert list(tok.tokenize(text)[0]) == full[:16]


def test_clip_flavour_reserves_top_ids_even_with_model_bos_eos(tmp_path):
  """A model with its own bos/eos pieces (SentencePiece's default bos=1, eos=2) still gets SOT/EOT on top:
  its own bos/eos never appear, so EOT stays the largest id."""
  import sentencepiece as spm

  corpus = tmp_path / "c.txt"
  corpus.write_text("\n".join(f"a red circle number {i} and a blue square" for i in range(200)))
  spm.SentencePieceTrainer.train(
    input=str(corpus), model_prefix=str(tmp_path / "m"), vocab_size=40, minloglevel=2
  )
  t = tok_lib.Tokenizer(str(tmp_path / "m.model"), max_len=12, flavour="clip", shift_ids=True)
  size = t._sp.get_piece_size() + 1  # shifted id space
  assert t._sp.bos_id() >= 0 and t._sp.eos_id() >= 0
  assert (t.sot_id, t.eot_id, t.vocab_size) == (size, size + 1, size + 2)
  ids = t.tokenize(["a red circle", "a blue square " * 5])
  own = {t._sp.bos_id() + 1, t._sp.eos_id() + 1}
  assert not own & set(ids.ravel().tolist())
  assert (ids[:, 0] == size).all() and (ids.max(-1) == size + 1).all()
  assert ids[1, -1] == size + 1  # truncated row still ends in EOT


def test_clip_flavour_pickles_and_validates(clip_tok):
  """The flavour survives pickling (grain workers); unknown flavours are refused with the valid ones."""
  clone = pickle.loads(pickle.dumps(clip_tok))
  assert clone.flavour == "clip"
  np.testing.assert_array_equal(clone.tokenize(["a star"]), clip_tok.tokenize(["a star"]))
  with pytest.raises(ValueError, match=r"flavour 'bpe' unknown.*\['tips', 'clip'\]"):
    tok_lib.Tokenizer(flavour="bpe")


@pytest.mark.parametrize(
  "recipe,flavour",
  [
    ("clip", "clip"),
    ("siglip", "clip"),
    ("ito", "clip"),
    ("tips", "tips"),
    ("tipsv2", "tips"),
    ("tipsito", "tips"),
  ],
)
def test_training_tokenization_follows_the_text_flavour(recipe, flavour):
  """The pipeline's tokenize step and `from_config` (vocabulary check, text vocab_size, training-time
  evals) use the text tower's flavour: SOT/EOT for the CLIP-style recipes only."""
  from tipsito.config import defaults
  from tipsito.data import pipeline

  c = defaults.tiny_config(recipe)
  assert c.model.text.flavour == flavour
  t = tok_lib.from_config(c)
  assert t.flavour == flavour and t.max_len == c.max_len
  ids = pipeline._tokenizer_for(c, None)(["a red circle"])
  np.testing.assert_array_equal(ids, t.tokenize(["a red circle"]))
  assert (ids[0, 0] == t.sot_id) == (flavour == "clip")
  assert pickle.loads(pickle.dumps(pipeline._tokenizer_for(c, None))).flavour == flavour
  # The text embedding is sized for those ids (vocab_size=None: from the tokenizer), and a config sized
  # for the model's pieces alone fails validation when SOT/EOT do not fit.
  from tipsito.config import validation
  from tipsito.data import prepare as data_prepare
  from tipsito.train import step as step_lib

  assert (
    step_lib.tokenizer_vocab_size(c)
    == t.vocab_size
    == tok_lib.Tokenizer().vocab_size + (2 if flavour == "clip" else 0)
  )
  c.model.text.vocab_size = tok_lib.Tokenizer().vocab_size
  if flavour == "clip":
    with pytest.raises(validation.ConfigError, match=r"vocabulary of 2002 \(2000 of the model \+ SOT/EOT"):
      data_prepare.check_tokenizer(c)
  else:
    data_prepare.check_tokenizer(c)
