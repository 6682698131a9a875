"""Convert GSM8K jsonl ({question, answer} per line) into verl-schema parquet.

    python tools/data/gsm8k.py --input_dir DIR --local_dir OUT [--limit N]

reads DIR/train.jsonl and DIR/test.jsonl and writes OUT/train.parquet and OUT/test.parquet,
one row per example as built by ``hybridengine.rl.data.to_verl_row``. Runs from a source
checkout without installing the package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from hybridengine.rl.data import convert_jsonl, to_verl_row
except ImportError:  # a source checkout, not installed: the repo root is two levels up
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from hybridengine.rl.data import convert_jsonl, to_verl_row

SPLITS = ("train", "test")


def convert_split(src: Path, dst: Path, split: str, limit: int | None) -> int:
    """Write ``dst`` from the GSM8K jsonl ``src``; returns the number of rows written."""
    return convert_jsonl(src, dst, lambda q, a, i: to_verl_row(q, a, split, i),
                         ("question", "answer"), "GSM8K", limit)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input_dir", required=True, help="folder with train.jsonl and test.jsonl")
    parser.add_argument("--local_dir", required=True, help="output folder for the parquet files")
    parser.add_argument("--limit", type=int, default=None, help="keep the first N rows per split")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    input_dir, local_dir = Path(args.input_dir), Path(args.local_dir)
    sources = {split: input_dir / f"{split}.jsonl" for split in SPLITS}
    for src in sources.values():
        if not src.is_file():
            raise SystemExit(f"error: GSM8K file not found: {src}")
    local_dir.mkdir(parents=True, exist_ok=True)
    for split, src in sources.items():
        dst = local_dir / f"{split}.parquet"
        try:
            num_rows = convert_split(src, dst, split, args.limit)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"wrote {dst} ({num_rows} rows from {src})")


if __name__ == "__main__":
    main()
