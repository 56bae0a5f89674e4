"""TFDS ExampleWriter that writes record files to gs:// as well (user-data builders, both paths).

Why: array_record's writer opens local files only ("open() failed: No such file or directory;
opening gs://..."), so TFDS cannot write an array_record dataset into a `gs://` data_dir by itself.
Each shard is written to a local temporary file and then copied to its (temporary, then renamed by
TFDS) place through etils epath (tipsito/paths.py). Local paths are written directly, as before.
Used through `_common.SingleInputSplit._example_writer` by tipsito/data/convert.py and
tipsito/data/beam_convert.py; a module-level class, so that Beam workers can unpickle it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from tensorflow_datasets.core import writer as writer_lib

from tipsito import paths


class ExampleWriter(writer_lib.ExampleWriter):
  """writer_lib.ExampleWriter; a URL `path` is written locally first, then uploaded."""

  def write(self, path, examples):
    """Writes `examples` ((key, serialized) pairs) to `path`; returns what TFDS's writer returns."""
    if not paths.is_url(os.fspath(path)):
      return super().write(path, examples)
    with tempfile.TemporaryDirectory(prefix="tipsito_shard_") as tmp:
      local = os.path.join(tmp, os.path.basename(os.fspath(path)))
      positions = super().write(local, examples)
      with open(local, "rb") as src, paths.as_path(path).open("wb") as dst:
        shutil.copyfileobj(src, dst, 16 << 20)
    return positions
