"""Make the embedded default job's prompt set: TinyStories-style openings whose reward is the
share of target words ("dog", "happy", "sun") the continuation uses (rl.rewards keyword).

    python tools/data/stories_keywords.py --out data/stories_keywords

Deterministic (no randomness): the same files every time. Rows use verl's schema.
"""
import argparse
import itertools
import json
from pathlib import Path

NAMES = ["Lily", "Tom", "Sue", "Ben", "Mia", "Max", "Anna", "Sam"]
OPENINGS = [
    "Once upon a time, {name} went to the",
    "One day, {name} saw a",
    "{name} was a little girl who liked to",
    "{name} had a big box. In the box there was a",
    "It was a cold day. {name} wanted to",
    "{name} and mom went to the",
    "There was a small house near the",
    "{name} found a shiny",
    "In the morning, {name} looked out of the window and saw",
    "{name} liked to draw. One day {name} drew a",
    "The little boat was on the",
    "{name} wanted to help. So {name}",
    "Once there was a tiny bird who",
    "{name} did not like to share. One day",
    "At the farm, {name} saw a cow and a",
    "{name} was sad because",
]
TARGET = ["dog", "happy", "sun"]


def rows(split: str) -> list[dict]:
    names = NAMES[:6] if split == "train" else NAMES[6:]
    out = []
    for k, (opening, name) in enumerate(itertools.product(OPENINGS, names)):
        text = opening.format(name=name)
        out.append({"data_source": "keyword", "prompt": [{"role": "user", "content": text}],
                    "ability": "story", "reward_model": {"style": "rule", "ground_truth": TARGET},
                    "extra_info": {"split": split, "index": k}})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="data/stories_keywords")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        path = out / f"{split}.jsonl"
        data = rows(split)
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
        print(f"wrote {path} ({len(data)} rows)")


if __name__ == "__main__":
    main()
