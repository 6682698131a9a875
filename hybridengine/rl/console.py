"""What a person reads on rank 0's console: a start-up header, one short line per step, a summary.

Contract:
- Pure formatting: no I/O, no torch (tools/plot.py imports tracking, which imports this). The
  Trainer prints the header (`header_lines(RunFacts.of(trainer, start))`), the Tracker prints
  the step lines and the summary.
- `step_line(metrics, step, total, eta_s)` keeps to the few numbers people watch — the training
  score, response length and clipped share, KL, throughput per device, step time, ETA,
  validation score — in fixed-width columns, under MAX_LINE characters; a field whose metric the
  step lacks is left out. metrics.jsonl keeps every metric; `HYBRIDENGINE_CONSOLE=verl` prints
  verl's full `step:N - key:value - ...` line instead (tracking.format_console).
- `StepClock` estimates the time left from the mean wall time of the steps run by this process.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

MAX_LINE = 200
FULL_LINE_ENV = "HYBRIDENGINE_CONSOLE"    # "verl": verl's full line per step

# the metric each column shows (verl's names); KL: the loss term, else the in-reward penalty
SCORE, VAL_SCORE = "critic/score/mean", "val/reward/mean"
LENGTH, CLIP = "response_length/mean", "response_length/clip_ratio"
KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty")
THROUGHPUT, STEP_TIME = "perf/throughput", "timing_s/step"
VAL_LENGTH = "val/response_length/mean"


def duration(seconds: float) -> str:
    """H:MM:SS, or M:SS under an hour."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _fixed(value: float, decimals: int, width: int) -> str:
    # fixed decimals keep columns aligned; a value too large for the column falls back to 3 digits
    text = f"{value:.{decimals}f}" if math.isfinite(value) else str(value)
    return (text if len(text) <= width else f"{value:.3g}").rjust(width)


def val_score(metrics: Mapping[str, float]) -> float | None:
    """The validation score of a record: val/reward/mean, else the first val/test_score/*."""
    if VAL_SCORE in metrics:
        return metrics[VAL_SCORE]
    scores = [metrics[k] for k in sorted(metrics) if k.startswith("val/test_score/")]
    return scores[0] if scores else None


def step_line(metrics: Mapping[str, float], step: int, total_steps: int | None = None,
              eta_s: float | None = None) -> str:
    """One step's console line, e.g.
    `step  7/20  score  0.271  len  48.0 clip 100%  kl 0.0812   1564 tok/s/dev   2.59 s  eta 0:33`
    (and `  val 0.797` when the step validated)."""
    width = len(str(total_steps)) if total_steps else 1
    parts = [f"step {step:>{width}}" + (f"/{total_steps}" if total_steps else "")]
    if SCORE in metrics:
        parts.append(f"score {_fixed(metrics[SCORE], 3, 6)}")
    if LENGTH in metrics:
        clip = f" clip {_fixed(100 * metrics[CLIP], 0, 3)}%" if CLIP in metrics else ""
        parts.append(f"len {_fixed(metrics[LENGTH], 1, 5)}{clip}")
    kl = next((metrics[k] for k in KL_KEYS if k in metrics), None)
    if kl is not None:
        parts.append(f"kl {kl:<#7.3g}")
    if THROUGHPUT in metrics:
        parts.append(f"{_fixed(metrics[THROUGHPUT], 0, 5)} tok/s/dev")
    if STEP_TIME in metrics:
        parts.append(f"{_fixed(metrics[STEP_TIME], 2, 5)} s")
    if eta_s is not None:
        parts.append(f"eta {duration(eta_s):>4}")
    val = val_score(metrics)
    if val is not None:
        before = "" if SCORE in metrics or VAL_LENGTH not in metrics \
            else f" (len {metrics[VAL_LENGTH]:.1f})"
        parts.append(f"val {val:.3f}{before}")
    return "  ".join(parts)[:MAX_LINE].rstrip()


class StepClock:
    """ETA = mean wall time per step since the clock started × steps left. `start(step)` (re)sets
    it: the Tracker restarts it on a record at or before the run's first step (the validation
    before training), so that validation's time is not charged to the training steps."""

    def __init__(self, total_steps: int | None, step: int = 0):
        self.total_steps = total_steps
        self.start(step)

    def start(self, step: int) -> None:
        self._t0, self._step0 = time.perf_counter(), step

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._t0

    def eta_s(self, step: int) -> float | None:
        """Seconds left after `step`; None without a total or before a step has run."""
        done = step - self._step0
        if not self.total_steps or done <= 0:
            return None
        return self.elapsed_s() / done * max(self.total_steps - step, 0)


def summary_line(first_step: int, last_step: int, elapsed_s: float,
                 vals: list[float]) -> str:
    """`done: steps 1-20 in 0:52 (2.60 s/step), val 0.034 -> 0.961`."""
    num = last_step - first_step + 1
    line = (f"done: step{'s' if num > 1 else ''} {first_step}"
            f"{f'-{last_step}' if num > 1 else ''} in {duration(elapsed_s)} "
            f"({elapsed_s / num:.2f} s/step)")
    if vals:
        line += f", val {vals[0]:.3f}" + (f" -> {vals[-1]:.3f}" if len(vals) > 1 else "")
    return line


# ----------------------------------------------------------------------------- header


def _digits3(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"      # 0.992, 12.5, 494, 1016: no exponent


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{_digits3(n / div)}{unit}"
    return str(n)


def _size(num_bytes: int) -> str:
    for div, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if num_bytes >= div:
            return f"{_digits3(num_bytes / div)} {unit}"
    return f"{num_bytes} B"


def _model(path: str, engine) -> str:
    mc, dtype = engine.cfg, engine.dtype
    return (f"{path}: {mc.model_type}, {_count(mc.num_params())} params ({mc.num_layers} layers "
            f"x {mc.hidden_size}), {_size(mc.num_params() * dtype.itemsize)} in "
            f"{str(dtype).removeprefix('torch.')} on {engine.device.type}")


def _fused(engine) -> str:
    """How many of a role's linear layers the gradient-accumulation fusion serves."""
    if engine.wgrad_fused:
        return f"({engine.wgrad_fused} linear layers)"
    return "(none: its linear layers' weights are frozen, LoRA)"


def _layout(role) -> str:
    sp = "+sp" if role.sequence_parallel else ""       # sequence parallelism inside the TP group
    cp = f" cp={role.cp} ({role.cp_attention})" if role.cp > 1 else ""
    return f"tp={role.tp}{sp} pp={role.pp} dp={role.dp}{cp}"


@dataclass(frozen=True)
class RunFacts:
    """What the header says about a run (all plain values, so the header is testable alone)."""

    name: str                      # project/experiment
    model: str                     # path: family, size, shape, dtype, device
    layout: str                    # per role
    algorithm: str
    data: str
    steps: str
    output: str
    start: str                     # fresh / resumed from global_step_N / already complete
    critic_model: str | None = None  # when the critic loads another model than the actor
    fusion: str | None = None      # gradient-accumulation fusion, where a role asks for it
    updates: str | None = None     # the critic's and actor's updates, where asked interleaved

    @classmethod
    def of(cls, trainer, start_step: int) -> RunFacts:
        """The facts of a built Trainer that resumed at `start_step` (0: a fresh run)."""
        cfg, lay = trainer.cfg, trainer.layout
        arr, d, t = cfg.actor_rollout_ref, cfg.data, cfg.trainer
        critic = trainer.critic
        roles = [f"actor {_layout(lay.actor)}",
                 f"rollout tp={lay.rollout.tp} dp={lay.rollout.dp} ({arr.rollout.name})"]
        roles += [f"{name} {_layout(role)}" for name, role in (("ref", lay.ref),
                                                                 ("critic", lay.critic)) if role]
        kl = ""
        if arr.actor.use_kl_loss:
            kl = f", KL loss {arr.actor.kl_loss_type} x{arr.actor.kl_loss_coef:g}"
        elif cfg.algorithm.use_kl_in_reward:
            kl = f", KL in reward {cfg.algorithm.kl_penalty} x{cfg.algorithm.kl_ctrl.kl_coef:g}"
        rc = cfg.algorithm.rollout_correction
        if rc.bypass_mode:      # an approximation a reader of the log should see
            kl += f", bypass mode (pi_old: the rollout's log-probs; {rc.loss_type} loss)"
        val = f", {len(trainer.val_ds)} val prompts" if trainer.val_ds is not None else ", no val"
        every = [f"validation every {t.test_freq}" if t.test_freq > 0 else "",
                 f"checkpoint every {t.save_freq}" if t.save_freq > 0 else ""]
        asked = [("actor", trainer.actor.engine, arr.actor.megatron)]
        asked += [("critic", critic.engine, cfg.critic.megatron)] if critic is not None else []
        fused = [f"{name} {_fused(engine)}" for name, engine, meg in asked
                 if meg.gradient_accumulation_fusion]
        why_not = trainer.not_interleaved
        return cls(
            updates=None if not t.interleave_updates else
            "critic and actor interleaved, a micro-batch of each in turn" if why_not is None
            else f"one after the other (not interleaved: {why_not})",
            fusion=("weight gradients into the fp32 buckets by their GEMMs: " + ", ".join(fused))
            if fused else None,
            name=f"{t.project_name}/{t.experiment_name}",
            model=_model(arr.model.path, trainer.actor.engine),
            critic_model=_model(cfg.critic.model.path, critic.engine)
            if critic is not None and cfg.critic.model.path != arr.model.path else None,
            layout=f"{trainer.world} rank{'s' if trainer.world > 1 else ''}: " + ", ".join(roles),
            algorithm=(f"{cfg.algorithm.adv_estimator}, {d.train_batch_size} prompts x "
                       f"{arr.rollout.n} response{'s' * (arr.rollout.n > 1)} per step"
                       + (f" ({d.gen_batch_size} prompts a generation round)"
                          if d.gen_batch_size != d.train_batch_size else "") + kl),
            data=(f"{len(trainer.train_ds)} train prompts{val} (prompt <= {d.max_prompt_length}, "
                  f"response <= {d.max_response_length} tokens)"),
            steps=(f"{trainer.total_steps} ({trainer.sampler.num_batches_per_epoch} per epoch)"
                   + "".join(f", {e}" for e in every if e) + (" and at the end" if any(every)
                                                               else "")),
            output=str(trainer.root),
            start=start_text(start_step, trainer.total_steps,
                             t.resume_from_path if t.resume_mode == "resume_path" else None))


def data_ran_out_line(step: int, total_steps: int, sampler) -> str:
    """The warning when the prompts end before trainer.total_training_steps."""
    s = sampler
    return (f"warning: stopped after step {step} of trainer.total_training_steps={total_steps}: "
            f"the data gives {len(s)} batches ({s.num_samples} prompts // data.gen_batch_size="
            f"{s.batch_size} = {s.num_batches_per_epoch} per epoch x trainer.total_epochs="
            f"{s.total_epochs})")


def start_text(start_step: int, total_steps: int, resume_path: str | None = None) -> str:
    """fresh / resumed from global_step_N / already complete (global_step_N of M)."""
    if start_step == 0:
        return "fresh"
    where = f" in {resume_path}" if resume_path else ""
    if start_step >= total_steps:
        return f"already complete (global_step_{start_step} of {total_steps}{where})"
    left = total_steps - start_step
    return f"resumed from global_step_{start_step}{where} ({left} step{'s' * (left > 1)} to go)"


def header_lines(facts: RunFacts) -> list[str]:
    """`key  value` rows, the keys in one column (the config layers in force are launch/ppo.py's
    line before it)."""
    rows = [("run", facts.name), ("model", facts.model), ("critic", facts.critic_model),
            ("layout", facts.layout), ("fusion", facts.fusion), ("updates", facts.updates),
            ("algorithm", facts.algorithm),
            ("data", facts.data),
            ("steps", facts.steps), ("output", facts.output), ("start", facts.start)]
    return [f"{k:<10} {v}" for k, v in rows if v is not None]
