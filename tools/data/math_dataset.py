"""Convert MATH jsonl ({problem, solution} per line) into verl-schema parquet, as verl's
examples/data_preprocess/math_dataset.py does.

    python tools/data/math_dataset.py --input_dir DIR --local_dir OUT \
        [--data_source HuggingFaceH4/MATH-500] [--limit N]

reads DIR/train.jsonl and/or DIR/test.jsonl (at least one) and writes OUT/<split>.parquet. The
ground truth is the content of the solution's last ``\\boxed{}`` (verl's MATH extraction), the
data_source verl's (DigitalLearningGmbH/MATH-lighteval by default; MATH-500 files, e.g.
/work/shared/data/math500, take --data_source HuggingFaceH4/MATH-500). Both route to verl's
boxed MATH scorer. Runs from a source checkout without installing the package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

try:
    from hybridengine.rl.data import convert_jsonl
    from hybridengine.rl.rewards_verl import last_boxed_only_string, remove_boxed
except ImportError:  # a source checkout, not installed: the repo root is two levels up
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from hybridengine.rl.data import convert_jsonl
    from hybridengine.rl.rewards_verl import last_boxed_only_string, remove_boxed

SPLITS = ("train", "test")
DATA_SOURCES = ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500")
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def to_math_row(problem: str, solution: str, split: str, index: int,
                data_source: str = DATA_SOURCES[0]) -> dict[str, Any]:
    """One MATH example as a verl row; the ground truth is the solution's last box."""
    boxed = last_boxed_only_string(solution)
    if boxed is None:
        raise ValueError(f"MATH {split} example {index}: solution has no \\boxed{{}} answer")
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": remove_boxed(boxed)},
        "extra_info": {"split": split, "index": index},
    }


def convert_split(src: Path, dst: Path, split: str, data_source: str, limit: int | None) -> int:
    """Write ``dst`` from the MATH jsonl ``src``; returns the number of rows written."""
    return convert_jsonl(src, dst, lambda p, sol, i: to_math_row(p, sol, split, i, data_source),
                         ("problem", "solution"), "MATH", limit)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input_dir", required=True, help="folder with train.jsonl / test.jsonl")
    parser.add_argument("--local_dir", required=True, help="output folder for the parquet files")
    parser.add_argument("--data_source", default=DATA_SOURCES[0], choices=DATA_SOURCES)
    parser.add_argument("--limit", type=int, default=None, help="keep the first N rows per split")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    input_dir, local_dir = Path(args.input_dir), Path(args.local_dir)
    sources = {s: input_dir / f"{s}.jsonl" for s in SPLITS if (input_dir / f"{s}.jsonl").is_file()}
    if not sources:
        raise SystemExit(f"error: no MATH file found: {input_dir}/train.jsonl or test.jsonl")
    local_dir.mkdir(parents=True, exist_ok=True)
    for split, src in sources.items():
        dst = local_dir / f"{split}.parquet"
        try:
            num_rows = convert_split(src, dst, split, args.data_source, args.limit)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"wrote {dst} ({num_rows} rows from {src})")


if __name__ == "__main__":
    main()
