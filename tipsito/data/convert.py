"""Builds tipsito datasets as sharded TFDS array_record: `python -m tipsito.data.convert NAME --data_dir DIR`.

Why one entry point: every dataset (procedural, Debian-packaged, user tables/tars) ends in the same
record schema and directory layout that `tipsito.data.sources` and `tfds.data_source` read, with a
skip report (`conversion_report.json` next to the array_record files) for the inputs left out.

Examples:
  python -m tipsito.data.convert shapes --data_dir ~/tfds                     # 2000/200 at 224 px
  python -m tipsito.data.convert shapes --data_dir /tmp/d --config_name tiny --image_size 32 \
      --split_sizes train=64,test=16
  python -m tipsito.data.convert shapes --data_dir /tmp/d --max_objects 2 --object_sizes medium,large
  python -m tipsito.data.convert scenes --data_dir ~/tfds                     # 10000/200/200 at 64 px
  python -m tipsito.data.convert scenes --data_dir /tmp/d --image_size 32 --split_sizes train=64,validation=8,test=8
  python -m tipsito.data.convert tuxpaint --data_dir ~/tfds --num_workers 4   # 785 stamps
  python -m tipsito.data.convert fashion_mnist --data_dir ~/tfds [--image_size 56] [--limit 1000]
  python -m tipsito.data.convert openclipart --data_dir ~/tfds [--image_size 256] [--limit 500]  # 8,121
  python -m tipsito.data.convert table --data_dir ~/tfds --input caps.tsv --config_name mycaps
  python -m tipsito.data.convert webdataset --data_dir ~/tfds --input 'shards/*.tar' --num_shards 8
  python -m tipsito.data.convert webdataset --data_dir gs://b/tfds --input 'gs://b/shards/{00000..09999}.tar' \
      --beam_runner DirectRunner|DataflowRunner|... [--beam_options '...']   # tipsito/data/beam_convert.py
Read back: tfds.data_source('shapes', data_dir=...) / 'scenes' / 'tuxpaint' / 'openclipart' / 'fashion_mnist/default' /
'table/mycaps', or tipsito.data.sources.open_source(config).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from tipsito.data.conversion import (  # noqa: F401  (the library, also re-exported for callers of this module)
  EXAMPLES_PER_SHARD,
  NAMES,
  ConversionError,
  ConvertResult,
  choose_num_shards,
  convert,
  parse_split_sizes,
)


def _parser() -> argparse.ArgumentParser:
  """argparse parser of the CLI (flags documented in --help)."""
  p = argparse.ArgumentParser(
    prog="python -m tipsito.data.convert",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("name", choices=NAMES)
  p.add_argument("--data_dir", required=True, help="TFDS data dir to write into")
  p.add_argument(
    "--input",
    dest="input_path",
    help="input file/dir/glob (table, webdataset; optional "
    "override of the Debian package dir for tuxpaint / fashion_mnist / openclipart)",
  )
  p.add_argument("--split_sizes", help="shapes, scenes: 'train=2000,test=200' (scenes also validation=N)")
  p.add_argument("--max_objects", type=int, help="shapes: 1..N objects per image (default 4); scenes: 2..N")
  p.add_argument("--object_sizes", help="shapes only: comma subset of small,medium,large (default all)")
  p.add_argument("--colours", help="shapes only: comma subset of the fill colours (default all ten)")
  p.add_argument(
    "--image_size",
    type=int,
    help="shapes, scenes: side; tuxpaint, openclipart: max side; fashion_mnist: upscale to",
  )
  p.add_argument("--num_workers", type=int, help="conversion processes (default: cores - 1)")
  p.add_argument("--num_shards", type=int, help="array_record shards per split (default: by size)")
  p.add_argument("--limit", type=int, help="at most this many inputs (per split for fashion_mnist)")
  p.add_argument("--config_name", help="TFDS config name (directory level); read as NAME/CONFIG")
  p.add_argument("--split", default="train", help="table/webdataset: split name")
  p.add_argument("--image_column", help="table: image path column")
  p.add_argument("--image_root", help="table: base dir of relative image paths (default: table's dir)")
  p.add_argument("--caption_columns", help="table/webdataset: comma list; the first is the alt-text")
  p.add_argument("--label_column", help="table: column to use as a ClassLabel")
  p.add_argument("--overwrite", action="store_true", help="rebuild even if already prepared")
  p.add_argument(
    "--beam_runner",
    help="table/webdataset: convert on Apache Beam (DirectRunner, "
    "DataflowRunner, FlinkRunner, ...; needs the [beam] extra), see tipsito/data/beam_convert.py",
  )
  p.add_argument(
    "--beam_options",
    help="Beam pipeline options, one shell-quoted string "
    "('--project=P --region=R --temp_location=gs://b/tmp')",
  )
  p.add_argument(
    "--rows_per_unit",
    type=int,
    help="Beam: table rows (or folder files) per unit of work (default 10000; a tar shard is one unit)",
  )
  return p


def _comma_list(text: str | None) -> tuple[str, ...] | None:
  """'a, b' -> ('a', 'b'); None/'' -> None (flag not given)."""
  return tuple(z.strip() for z in text.split(",") if z.strip()) if text else None


def main(argv: Sequence[str] | None = None) -> ConvertResult:
  """CLI entry point; returns the ConvertResult (tests call it directly)."""
  args = _parser().parse_args(argv)
  extra = {}
  if args.name in ("table", "webdataset"):
    extra["split"] = args.split
    if args.caption_columns:
      extra["caption_columns"] = [c.strip() for c in args.caption_columns.split(",") if c.strip()]
  if args.name == "table":
    for k in ("image_column", "image_root", "label_column"):
      if getattr(args, k):
        extra[k] = getattr(args, k)
  return convert(
    args.name,
    args.data_dir,
    input_path=args.input_path,
    split_sizes=parse_split_sizes(args.split_sizes),
    image_size=args.image_size,
    num_workers=args.num_workers,
    num_shards=args.num_shards,
    limit=args.limit,
    config_name=args.config_name,
    overwrite=args.overwrite,
    max_objects=args.max_objects,
    object_sizes=_comma_list(args.object_sizes),
    colours=_comma_list(args.colours),
    beam_runner=args.beam_runner,
    beam_options=args.beam_options,
    rows_per_unit=args.rows_per_unit,
    **extra,
  )


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  try:
    main(sys.argv[1:])
  except (ConversionError, ValueError, FileNotFoundError) as err:
    sys.exit(f"error: {err}")
