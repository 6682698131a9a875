"""Plot a run's metrics.jsonl (written by hybridengine.rl.tracking.Tracker) to a PNG.

    python tools/plot.py path/to/metrics.jsonl [--out plot.png] [--max-response-length N]
    python tools/plot.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl ... [--labels A,B] --out cmp.png

Panels against step: reward (critic/score/mean and validation val/* keys), KL (actor/ppo_kl,
actor/reward_kl_penalty, actor/kl_loss), response length (response_length/mean and
val/*response_length* keys; the clipped share, response_length/clip_ratio, in % on the right
axis; data.max_response_length as a dashed line), throughput (perf/throughput, tokens/s per
device). A panel shows the keys the file has and is left out when it has none; a series equal
to one drawn before it is drawn dashed on top and labelled "(= other key)", so that neither
hides the other. Records logged at the same step (train and validation metrics in separate
calls) are merged. max_response_length is not in metrics.jsonl: --max-response-length gives
it, else it is read off a step that clipped (its response_length/max is the limit). The output
defaults to metrics.png beside the input. Runs from a source checkout without installing the
package.

With several metrics files, one figure compares the runs (e.g. GRPO against PPO on one task):
validation score (val/reward/mean) against step and against minutes of training (the sum of
timing_s/step: compilation, generation, validation and updates alike; checkpoint writes are not
in it), and the training score (critic/score/mean, a 10-step running mean) against step.
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


CLIP_KEY = "response_length/clip_ratio"


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
    share: str | None = None  # a 0..1 key drawn in % on the right axis

    def select(self, present: list[str]) -> list[str]:
        extra = sorted(k for k in present if self.also and self.also(k))
        return [k for k in self.keys if k in present] + extra


PANELS = (
    Panel("reward", "score", ("critic/score/mean",), _is_val_reward),
    Panel("KL", "KL", ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss")),
    Panel("response length", "tokens", ("response_length/mean",), _is_val_length,
          share=CLIP_KEY),
    Panel("throughput", "tokens/s per device", ("perf/throughput",)),
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


def infer_max_response_length(by_step: dict[int, dict]) -> int | None:
    """data.max_response_length, read off a step that clipped: a clipped response is exactly
    that long, so the step's response_length/max is the limit. None when no step clipped."""
    for m in by_step.values():
        if (m.get(CLIP_KEY) or 0) > 0 and m.get("response_length/max") is not None:
            return int(m["response_length/max"])
    return None


def same_as(by_step: dict[int, dict], keys: list[str]) -> dict[str, str]:
    """{key: an earlier key of `keys` with the same steps and values} (their lines coincide)."""
    drawn: dict[tuple, str] = {}
    out = {}
    for key in keys:
        steps, values = series(by_step, key)
        signature = (tuple(steps), tuple(values))
        if signature in drawn:
            out[key] = drawn[signature]
        else:
            drawn[signature] = key
    return out


def _draw_panel(ax, panel: Panel, panel_keys: list[str], by_step: dict[int, dict],
                max_response_length: int | None) -> None:
    twins = same_as(by_step, panel_keys)
    for key in panel_keys:
        steps, values = series(by_step, key)
        # Sparse series (validation) get markers so a single point is still visible.
        marker = "o" if len(steps) < len(by_step) else None
        if key in twins:   # dashed over the line it equals: both colours stay visible
            ax.plot(steps, values, label=f"{key} (= {twins[key]})", marker=marker and "x",
                    markersize=5, linestyle=(0, (4, 4)), zorder=3)
        else:
            ax.plot(steps, values, label=key, marker=marker, markersize=3)
    if panel.share:        # lengths from 0, so that the distance to the limit reads true
        if max_response_length is not None:
            ax.axhline(max_response_length, color="tab:red", linestyle="--", linewidth=1,
                       label=f"max_response_length = {max_response_length}")
        ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1.08 * (max_response_length or 0)))
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    legend_ax, (handles, labels) = ax, ax.get_legend_handles_labels()
    steps, values = series(by_step, panel.share) if panel.share else ([], [])
    if steps:
        legend_ax = ax.twinx()   # drawn over ax: the legend goes on it to stay on top
        legend_ax.plot(steps, [100 * v for v in values], color="tab:gray", linestyle=":",
                       label=f"clipped % ({panel.share})")
        legend_ax.set_ylim(-5, 105)
        legend_ax.set_ylabel("clipped % (right axis)")
        more_handles, more_labels = legend_ax.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    legend_ax.legend(handles, labels, fontsize=8)


def figure(by_step: dict[int, dict], max_response_length: int | None = None,
           title: str = "") -> tuple[plt.Figure, list[str]]:
    """The figure and the titles of its panels; max_response_length None: inferred."""
    keys = sorted({k for m in by_step.values() for k in m if k != "step"})
    panels = [(panel, panel.select(keys)) for panel in PANELS]
    panels = [(panel, panel_keys) for panel, panel_keys in panels if panel_keys]
    if not panels:
        wanted = ", ".join(k for panel in PANELS for k in panel.keys)
        raise ValueError(f"no plottable keys (looked for {wanted}, val/*)")
    if max_response_length is None:
        max_response_length = infer_max_response_length(by_step)
    ncols = 1 if len(panels) == 1 else 2
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3.5 * nrows), squeeze=False)
    for ax, (panel, panel_keys) in zip(axes.flat, panels):
        _draw_panel(ax, panel, panel_keys, by_step, max_response_length)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig, [panel.title for panel, _ in panels]


def plot(metrics_path: Path, out_path: Path, max_response_length: int | None = None) -> list[str]:
    """Write the PNG; returns the titles of the panels drawn."""
    try:
        fig, titles = figure(merge_by_step(read_metrics(metrics_path)), max_response_length,
                             str(metrics_path))
    except ValueError as err:
        raise ValueError(f"{metrics_path}: {err}") from None
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return titles


VAL_KEY, TRAIN_KEY, STEP_SECONDS = "val/reward/mean", "critic/score/mean", "timing_s/step"


def training_minutes(by_step: dict[int, dict]) -> dict[int, float]:
    """{step: minutes of training up to the end of that step}; step 0 (validation before
    training) is at 0."""
    total, out = 0.0, {}
    for step, m in by_step.items():
        total += m.get(STEP_SECONDS) or 0.0
        out[step] = total / 60
    return out


def running_mean(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def compare_figure(runs: dict[str, dict[int, dict]]) -> plt.Figure:
    """Validation score against step and against training minutes, and the 10-step running
    mean of the training score against step, one line per run."""
    fig, axes = plt.subplots(1, 3, figsize=(17, 4), squeeze=False)
    by_step_ax, by_time_ax, train_ax = axes.flat
    for label, by_step in runs.items():
        steps, values = series(by_step, VAL_KEY)
        minutes = training_minutes(by_step)
        by_step_ax.plot(steps, values, marker="o", markersize=3, label=label)
        by_time_ax.plot([minutes[s] for s in steps], values, marker="o", markersize=3,
                        label=label)
        steps, values = series(by_step, TRAIN_KEY)
        train_ax.plot(steps, running_mean(values, 10), label=label)
    for ax, title, xlabel in ((by_step_ax, f"validation ({VAL_KEY})", "step"),
                              (by_time_ax, f"validation ({VAL_KEY})",
                               f"minutes of training (sum of {STEP_SECONDS})"),
                              (train_ax, f"training score ({TRAIN_KEY}, 10-step mean)", "step")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def compare(metrics_paths: list[Path], labels: list[str], out_path: Path) -> None:
    runs = {}
    for label, path in zip(labels, metrics_paths):
        by_step = merge_by_step(read_metrics(path))
        if not any(VAL_KEY in m or TRAIN_KEY in m for m in by_step.values()):
            raise ValueError(f"{path}: neither {VAL_KEY} nor {TRAIN_KEY} in it")
        runs[label] = by_step
    fig = compare_figure(runs)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path, nargs="+",
                        help="metrics.jsonl written by the trainer; several: a comparison")
    parser.add_argument("--labels", default=None,
                        help="comparison: the runs' names, comma-separated (default: the "
                             "files' folder names)")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG to write (default: metrics.png beside the input)")
    parser.add_argument("--max-response-length", type=int, default=None,
                        help="data.max_response_length, drawn on the length panel (default: "
                             "read off a step that clipped)")
    args = parser.parse_args(argv)
    if len(args.metrics) > 1:
        labels = args.labels.split(",") if args.labels else \
            [p.parent.name or str(p) for p in args.metrics]
        if len(labels) != len(args.metrics):
            sys.exit(f"plot.py: --labels names {len(labels)} runs for {len(args.metrics)} "
                     f"metrics files")
        if args.out is None:
            sys.exit("plot.py: a comparison of several runs needs --out")
        try:
            compare(args.metrics, labels, args.out)
        except (FileNotFoundError, ValueError) as err:
            sys.exit(f"plot.py: {err}")
        print(f"wrote {args.out} (comparison of {', '.join(labels)})")
        return
    metrics = args.metrics[0]
    out = args.out or metrics.with_suffix(".png")
    try:
        titles = plot(metrics, out, args.max_response_length)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"plot.py: {err}")
    print(f"wrote {out} ({', '.join(titles)})")


if __name__ == "__main__":
    main()
