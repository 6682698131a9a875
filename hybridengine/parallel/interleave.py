"""Steps of several engines' work interleaved on one host thread.

A unit of work that may be interleaved is a generator: it queues some device work, yields
(a point where the host may queue another unit's work), and returns its result. One unit runs
alone with run_to_end; several run in turns with round_robin. On one CUDA stream the device
still runs every kernel in the order queued: what interleaving changes is when the host queues
them, so that one unit's host work (Python, launches) overlaps another's device work instead of
leaving the device idle, and the results are those of running the units one after another.
Every rank must interleave the same units in the same order (their collectives then match).
"""
from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TypeVar

T = TypeVar("T")


def run_to_end(steps: Generator[None, None, T]) -> T:
    """The unit `steps` run alone: its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def round_robin(units: Sequence[Generator]) -> list:
    """Each unit advanced one step in turn, in the given order, until all have returned; their
    return values, in that order. A unit that returns early drops out of the turns."""
    results: list = [None] * len(units)
    live = list(range(len(units)))
    while live:
        for i in list(live):
            try:
                next(units[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
    return results
