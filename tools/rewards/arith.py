"""Reward of the arithmetic task (tools/data/arith.py), as a verl custom reward function:

    custom_reward_function.path=tools/rewards/arith.py   (name: compute_score, the default)

1.0 when the first integer in the response equals the ground truth, else 0.0 ("Answer with just
the number": "The answer is 140" scores, "47 + 93 = 140" does not). An integer may carry a sign
('-' or the Unicode minus) and thousands commas ("1,998"). Self-contained: the trainer imports
this file by path.
"""

from __future__ import annotations

import re
from typing import Any

# optional sign, then digits with optional thousands groups; not part of a longer word/number
_INTEGER = re.compile(r"(?<![\w.])([-\u2212]?)(\d{1,3}(?:,\d{3})+|\d+)(?![\d])")


def first_integer(text: str) -> int | None:
    """The first integer written in ``text``, or None."""
    match = _INTEGER.search(text)
    if match is None:
        return None
    sign, digits = match.groups()
    value = int(digits.replace(",", ""))
    return -value if sign else value


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: dict | None = None) -> dict[str, float]:
    """``{"score": 1.0 or 0.0, "acc": same}``: exact match of the response's first integer."""
    answer = first_integer(solution_str)
    correct = answer is not None and answer == int(str(ground_truth).strip())
    return {"score": float(correct), "acc": float(correct)}
