"""Make the arithmetic task: "What is A op B? Answer with just the number." as verl-schema parquet.

    python tools/data/arith.py --local_dir data/processed/arith [--train_size 32000]
        [--test_size 500] [--seed 0]

writes OUT/train.parquet and OUT/test.parquet. Five kinds of problem, in equal shares (the row
index cycles through them): 2-digit + 2-digit, 3-digit + 3-digit, 2-digit * 1-digit (2-9),
2-digit - 2-digit (the answer may be negative), 2-digit * 2-digit. The operators are the ASCII
ones a user types: '+', '-', '*'. Seeded: the same files for the same arguments; no test problem
appears in the training split. Rows use verl's schema (``data_source`` "arith", the answer as
``reward_model.ground_truth``); the reward is tools/rewards/arith.py (the first integer of the
response must equal the answer).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "arith"
TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
# kind -> (operator, range of a, range of b); ranges are inclusive
KINDS: dict[str, tuple[str, tuple[int, int], tuple[int, int]]] = {
    "2d+2d": ("+", (10, 99), (10, 99)),
    "3d+3d": ("+", (100, 999), (100, 999)),
    "2d*1d": ("*", (10, 99), (2, 9)),
    "2d-2d": ("-", (10, 99), (10, 99)),
    "2d*2d": ("*", (10, 99), (10, 99)),
}
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_row(kind: str, a: int, b: int, split: str, index: int) -> dict:
    """One problem as a verl row."""
    op = KINDS[kind][0]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": TEMPLATE.format(a=a, op=op, b=b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(OPS[op](a, b))},
        "extra_info": {"split": split, "index": index, "kind": kind, "a": a, "b": b},
    }


def sample_split(rng: random.Random, split: str, size: int, exclude: set[tuple[str, int, int]],
                 distinct: bool = False) -> list[dict]:
    """``size`` rows, kinds in turn; a problem in ``exclude`` is drawn again. ``distinct``: each
    problem drawn joins ``exclude`` (no repeats)."""
    rows: list[dict] = []
    kinds = list(KINDS)
    while len(rows) < size:
        kind = kinds[len(rows) % len(kinds)]
        _, (a_lo, a_hi), (b_lo, b_hi) = KINDS[kind]
        a, b = rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)
        if (kind, a, b) in exclude:
            continue
        if distinct:
            exclude.add((kind, a, b))
        rows.append(make_row(kind, a, b, split, len(rows)))
    return rows


def max_distinct() -> int:
    """The most distinct problems a split can hold with the kinds in equal shares."""
    return len(KINDS) * min((a_hi - a_lo + 1) * (b_hi - b_lo + 1)
                            for _, (a_lo, a_hi), (b_lo, b_hi) in KINDS.values())


def make_splits(train_size: int, test_size: int, seed: int) -> dict[str, list[dict]]:
    """Test problems are distinct; training problems may repeat but never appear in test."""
    rng = random.Random(seed)
    test_problems: set[tuple[str, int, int]] = set()
    test = sample_split(rng, "test", test_size, test_problems, distinct=True)
    return {"train": sample_split(rng, "train", train_size, test_problems), "test": test}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_dir", default="data/processed/arith",
                        help="output folder for train.parquet and test.parquet")
    parser.add_argument("--train_size", type=int, default=32000,
                        help="training problems (default: 500 steps x 64 prompts)")
    parser.add_argument("--test_size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.train_size < 1 or not 1 <= args.test_size <= max_distinct():
        parser.error(f"--train_size must be >= 1 and --test_size in [1, {max_distinct()}]")
    out = Path(args.local_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in make_splits(args.train_size, args.test_size, args.seed).items():
        path = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        print(f"wrote {path} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
