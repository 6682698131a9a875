"""verl's learning-rate schedules (constant or cosine, with linear warm-up), as a pure function of
the number of schedule steps taken."""
from __future__ import annotations

import math
from dataclasses import dataclass

WARMUP_STYLES = ("constant", "cosine")


def first_error(checks: list[tuple[bool, str]]) -> None:
    """Raise the message of the first failed (ok, message) check as one ValueError line."""
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


@dataclass(frozen=True)
class LRSchedule:
    """verl's optim schedule: lr, lr_warmup_steps (-1: lr_warmup_steps_ratio·total_training_steps),
    warmup_style constant | cosine, min_lr_ratio, num_cycles.

    `step` in get_lr is the number of schedule steps already taken (0 for the first update), as
    a LambdaLR stepped once per trainer step.
        constant  lr·step/w during warm-up (step < w), then lr
        cosine    lr·(m + (1-m)·step/w) during warm-up, then
                  lr·max(m, m + (1-m)·(1 + cos(2π·num_cycles·progress))/2),
                  progress = (step - w) / max(1, total_steps - w)
    """

    lr: float
    total_steps: int = 0
    warmup_steps: int = -1
    warmup_steps_ratio: float = 0.0
    warmup_style: str = "constant"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5

    def __post_init__(self):
        first_error([
            (self.lr >= 0, f"optim.lr={self.lr} must be >= 0"),
            (self.warmup_style in WARMUP_STYLES,
             f"optim.warmup_style={self.warmup_style!r} is unknown; choose from {WARMUP_STYLES}"),
            (0.0 <= self.min_lr_ratio <= 1.0, f"optim.min_lr_ratio={self.min_lr_ratio} must be "
                                               f"in [0, 1]"),
            (0.0 <= self.warmup_steps_ratio <= 1.0,
             f"optim.lr_warmup_steps_ratio={self.warmup_steps_ratio} must be in [0, 1]"),
            (self.warmup_style != "cosine" or self.total_steps > 0,
             f"warmup_style='cosine' needs total_training_steps > 0, got {self.total_steps}")])

    @property
    def num_warmup_steps(self) -> int:
        if self.warmup_steps >= 0:
            return self.warmup_steps
        return int(self.warmup_steps_ratio * self.total_steps)

    def get_lr(self, step: int) -> float:
        w, m = self.num_warmup_steps, self.min_lr_ratio
        if self.warmup_style == "constant":
            return self.lr * (step / max(1, w) if step < w else 1.0)
        if step < w:
            return self.lr * (m + (1.0 - m) * step / max(1, w))
        progress = (step - w) / max(1, self.total_steps - w)
        cosine = 0.5 * (1.0 + math.cos(2.0 * math.pi * self.num_cycles * progress))
        return self.lr * max(m, m + (1.0 - m) * cosine)
