"""Plot a run's metrics.jsonl (written by hybridengine.rl.tracking.Tracker) to a PNG.

    python tools/plot.py path/to/metrics.jsonl [--out plot.png]

Panels against step: reward (critic/score/mean and validation val/* keys), KL (actor/ppo_kl,
actor/reward_kl_penalty, actor/kl_loss), response length (response_length/mean and
val/*response_length* keys), throughput (perf/throughput). A panel shows the keys the file has
and is left out when it has none; records logged at the same step (train and validation
metrics in separate calls) are merged. The output defaults to metrics.png beside the input.
Runs from a source checkout without installing the package.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: must precede the pyplot import
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

try:
    from hybridengine.rl.tracking import read_metrics
except ImportError:  # a source checkout, not installed: the repo root is one level up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hybridengine.rl.tracking import read_metrics


def _is_val_length(key: str) -> bool:
    return key.startswith("val/") and "response_length" in key


def _is_val_reward(key: str) -> bool:
    return key.startswith("val/") and "length" not in key


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    keys: tuple[str, ...]  # drawn when present, in this order
    also: Callable[[str], bool] | None = None  # further keys to draw (validation), sorted

    def select(self, present: list[str]) -> list[str]:
        extra = sorted(k for k in present if self.also and self.also(k))
        return [k for k in self.keys if k in present] + extra


PANELS = (
    Panel("reward", "score", ("critic/score/mean",), _is_val_reward),
    Panel("KL", "KL", ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss")),
    Panel("response length", "tokens", ("response_length/mean",), _is_val_length),
    Panel("throughput", "tokens/s/GPU", ("perf/throughput",)),
)


def merge_by_step(records: list[dict]) -> dict[int, dict]:
    """{step: metrics}; a later record's keys win at the same step (e.g. a resumed run)."""
    merged: dict[int, dict] = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(record)
    return dict(sorted(merged.items()))


def series(by_step: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of `key`, skipping steps without it (validation runs every few)."""
    points = [(step, m[key]) for step, m in by_step.items()
              if m.get(key) is not None and math.isfinite(m[key])]
    return [s for s, _ in points], [v for _, v in points]


def plot(metrics_path: Path, out_path: Path) -> list[str]:
    """Write the PNG; returns the titles of the panels drawn."""
    by_step = merge_by_step(read_metrics(metrics_path))
    keys = sorted({k for m in by_step.values() for k in m if k != "step"})
    panels = [(panel, panel.select(keys)) for panel in PANELS]
    panels = [(panel, panel_keys) for panel, panel_keys in panels if panel_keys]
    if not panels:
        wanted = ", ".join(k for panel in PANELS for k in panel.keys)
        raise ValueError(f"{metrics_path}: no plottable keys (looked for {wanted}, val/*)")
    ncols = 1 if len(panels) == 1 else 2
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3.5 * nrows), squeeze=False)
    for ax, (panel, panel_keys) in zip(axes.flat, panels):
        for key in panel_keys:
            steps, values = series(by_step, key)
            # Sparse series (validation) get markers so a single point is still visible.
            marker = "o" if len(steps) < len(by_step) else None
            ax.plot(steps, values, label=key, marker=marker, markersize=3)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(str(metrics_path), fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return [panel.title for panel, _ in panels]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, help="metrics.jsonl written by the trainer")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG to write (default: metrics.png beside the input)")
    args = parser.parse_args(argv)
    out = args.out or args.metrics.with_suffix(".png")
    try:
        titles = plot(args.metrics, out)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"plot.py: {err}")
    print(f"wrote {out} ({', '.join(titles)})")


if __name__ == "__main__":
    main()
