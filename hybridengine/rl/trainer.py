"""The PPO / GRPO / DAPO trainer loop (SPMD: every rank runs it; ../shared/DESIGN.md "One PPO step").

    1. switch → generation, rollout, switch → training   (hybrid.generator: HybridEngine + Engine)
    2. reward: rule / custom function on decoded text (DAPO: overlong penalty, dynamic sampling)
    3. old log-probs (actor), reference log-probs, values (critic): forward-only, packed
    4. advantages: GAE or group-relative; KL in the reward (controller) or in the loss
    5. update: critic then actor, mini-batches × epochs (or the two interleaved)
    6. metrics with verl's names; validation every test_freq; checkpoint every save_freq
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch.profiler import record_function

from hybridengine.config import uses_critic, uses_reference
from hybridengine.config.run import RunConfig
from hybridengine.device_memory import configure_allocator, start_window, window_peak
from hybridengine.train.engine import TrainEngine
from hybridengine.train import checkpoint as ckpt
from hybridengine.parallel.mesh import Meshes, build_meshes
from hybridengine.rl.advantages import apply_kl_penalty, get_adv_estimator, make_kl_controller
from hybridengine.rl.batch import Batch
from hybridengine.rl.console import RunFacts, data_ran_out_line, header_lines
from hybridengine.rl.data import PromptDataset, ResumableSampler, load_rows, load_tokenizer
from hybridengine.hybrid.generator import Generator
from hybridengine.rl.checkpointing import RunCheckpoints
from hybridengine.rl.gc_freeze import GcFreeze
from hybridengine.rl.guards import Phases, inject_faults, skipped_updates
from hybridengine.models.lora import LoRAConfig
from hybridengine.rl.metrics import batch_metrics, perf_metrics, step_flops
from hybridengine.rl.residency import Residency, offload_parts
from hybridengine.rl.rewards import build_reward
from hybridengine.rl.flops import peak_flops
from hybridengine.parallel.interleave import round_robin
from hybridengine.rl.roles import INTERLEAVED, Actor, Critic, Reference, interleave_off, \
    optim_config, metrics_as_floats
from hybridengine.rl.rollout import RolloutCollector
from hybridengine.rl.run_dir import claim_run_dir
from hybridengine.rl.bypass import bypass_old_logprob
from hybridengine.rl.rollout_correction import RolloutCorrectionConfig, apply_rollout_correction
from hybridengine.rl.memory import memory_report, param_dtype
from hybridengine.rl.preflight import checked_run_config, run_device
from hybridengine.rl.tracking import Tracker, timer


def scoring_temperature(rollout_cfg) -> float:
    """The temperature of the log-probs the trainer computes: the rollout's sampling temperature
    (verl divides the logits by it in every actor and reference forward); 1 for greedy rollouts,
    whose tokens have no temperature."""
    t = float(rollout_cfg.temperature)
    return t if rollout_cfg.do_sample and t > 0 else 1.0


class Trainer:
    """One RL run of the typed config `cfg` (config.run.RunConfig; a loaded tree is checked
    and typed here) on the process groups `meshes` (parallel.mesh.build_meshes: launch/ppo.py
    builds both). meshes None: a run of this process alone (tests, benchmarks)."""

    def __init__(self, cfg: RunConfig | DictConfig, meshes: Meshes | None = None):
        if not isinstance(cfg, RunConfig):    # a loaded tree: every error at once, before
            cfg = checked_run_config(cfg, meshes.world_size if meshes else 1)  # anything loads
        if meshes is None:
            meshes = build_meshes(cfg.layout, cfg.trainer.collective_timeout_s)
        if meshes.layout != cfg.layout:
            raise ValueError(f"the process groups were built for {meshes.layout}, the config "
                             f"asks for {cfg.layout}")
        self.cfg, self.meshes, self.layout = cfg, meshes, cfg.layout
        self.rank, self.world = meshes.rank, meshes.world_size
        self.device, t = run_device(cfg), cfg.trainer
        # before the models load: expandable segments apply to the segments mapped after this
        self.cuda_allocator = configure_allocator(t.cuda_allocator,
                                                  cfg.actor_rollout_ref.rollout.name, self.device)
        self.root = Path(t.default_local_dir)
        # before anything loads: a second run on this directory, or a fresh start over an
        # earlier run, fails in a second and leaves the directory as it was (rl.run_dir)
        self.run_lock = claim_run_dir(
            self.root, t.resume_mode, bool(t.overwrite), rank=self.rank,
            resumable=t.resume_mode == "resume_path"
            or (t.resume_mode == "auto" and ckpt.find_latest(self.root) is not None),
            group=meshes.world)
        self.phases = Phases(self.rank, cfg.trainer.collective_timeout_s)
        self.phase_peaks: dict[str, int] = {}   # this step's device peak per phase (CUDA)
        self.gc_freeze = GcFreeze(t.gc_freeze_freq)   # full collections between steps only
        torch.manual_seed(cfg.trainer.seed)
        model = cfg.actor_rollout_ref.model
        self.tokenizer = load_tokenizer(model.path, model.trust_remote_code)
        crf = cfg.custom_reward_function   # before the models: a wrong path fails in a second
        self.reward_fn = build_reward(crf.path, crf.name, crf.weights)
        self._build_data()
        self.total_steps = cfg.trainer.total_training_steps or len(self.sampler)
        self.rollout_correction = RolloutCorrectionConfig.from_config(
            cfg.algorithm.rollout_correction)
        self.bypass = self.rollout_correction.bypass_mode     # pi_old = pi_rollout (rl.bypass)
        with self.phases.enter("setup"):
            self._build_roles()
        self.not_interleaved = interleave_off(self.actor, self.critic)    # why not, if asked
        self.interleaved = t.interleave_updates and self.not_interleaved is None
        self.kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
        self.collector = RolloutCollector(cfg, self.tokenizer, self.generator, self.reward_fn,
                                          rank=self.rank)
        self.peak = peak_flops() if self.device.type == "cuda" else None
        self.checkpoints = RunCheckpoints(self.root, meshes.world, self.rank,
                                          {"actor": self.actor, "critic": self.critic},
                                          self.sampler, self.kl_ctrl, self.residency)

    # --- setup --------------------------------------------------------------------------------
    def _build_data(self):
        d = self.cfg.data
        kw = dict(tokenizer=self.tokenizer, max_prompt_length=d.max_prompt_length,
                  truncation=d.truncation, filter_overlong_prompts=d.filter_overlong_prompts,
                  prompt_key=d.prompt_key, reward_fn_key=d.reward_fn_key)
        self.train_ds = PromptDataset(load_rows(d.train_files, d.prompt_key, d.reward_fn_key), **kw)
        self.val_ds = PromptDataset(load_rows(d.val_files, d.prompt_key, d.reward_fn_key), **kw) \
            if d.val_files else None
        self.sampler = ResumableSampler(len(self.train_ds), d.gen_batch_size,  # a round, as verl
                                        self.cfg.trainer.total_epochs, d.seed, d.shuffle)

    def _build_roles(self):
        cfg, lay, meshes = self.cfg, self.layout, self.meshes
        arr = cfg.actor_rollout_ref
        a_meg = arr.actor.megatron
        dtype = param_dtype(a_meg.param_dtype, self.device)
        compile_lm = bool(arr.actor.use_torch_compile)
        # verl scores old / ref / current log-probs (and the entropy) at the rollout temperature,
        # so the ratio and the KL are those of the policy that sampled
        temperature = scoring_temperature(arr.rollout)
        lora = LoRAConfig.of_model(arr.model)
        actor_engine = TrainEngine(
            arr.model.path, meshes.actor, dtype=dtype, device=self.device,
            sequence_parallel=lay.actor.sequence_parallel, compile_layers=compile_lm,
            temperature=temperature, offload=offload_parts(a_meg, True),
            recompute=bool(arr.model.enable_gradient_checkpointing),
            optim=optim_config(arr.actor.optim, a_meg, arr.actor.grad_clip, self.total_steps),
            lora=lora, cuda_graphs=bool(arr.actor.use_cuda_graph),
            wgrad_fusion=bool(a_meg.gradient_accumulation_fusion),
            router_losses=(arr.actor.router_aux_loss_coef, arr.actor.router_z_loss_coef))
        self.actor = Actor(actor_engine, arr, self.rollout_correction)
        self.ref = None
        if uses_reference(cfg) and lora is not None:    # the base: the actor's adapters off
            self.ref = Reference(actor_engine, arr.ref, base_of_actor=True)
        elif uses_reference(cfg):
            self.ref = Reference(TrainEngine(
                arr.model.path, meshes.ref, dtype=dtype, device=self.device,
                compile_layers=compile_lm, temperature=temperature,
                sequence_parallel=lay.ref.sequence_parallel), arr.ref)
        self.critic = None
        if uses_critic(cfg):
            c = cfg.critic
            critic_engine = TrainEngine(
                c.model.path, meshes.critic, value_head=True, cuda_graphs=bool(c.use_cuda_graph),
                compile_layers=bool(c.use_torch_compile), offload=offload_parts(c.megatron, True),
                recompute=bool(c.model.enable_gradient_checkpointing),
                dtype=param_dtype(c.megatron.param_dtype, self.device), device=self.device,
                sequence_parallel=lay.critic.sequence_parallel,
                lora=LoRAConfig.of_model(c.model),
                optim=optim_config(c.optim, c.megatron, c.grad_clip, self.total_steps),
                wgrad_fusion=bool(c.megatron.gradient_accumulation_fusion))
            self.critic = Critic(critic_engine, c, arr.actor.loss_agg_mode)
        offload = {"actor": (actor_engine, actor_engine.offload)}
        if self.ref is not None and not self.ref.base_of_actor:
            offload["ref"] = (self.ref.engine, offload_parts(arr.ref.megatron, False))
        if self.critic is not None:
            offload["critic"] = (self.critic.engine, self.critic.engine.offload)
        self.residency = Residency(offload)
        r, h = arr.rollout, cfg.trainer.hybrid_engine
        self.generator = Generator(actor_engine, meshes.gen, r,
                                   h.reshard_mode, h.reshard_bucket_mb,
                                   param_dtype(r.dtype, self.device),
                                   cfg.data.max_prompt_length + cfg.data.max_response_length,
                                   residency=self.residency,
                                   direct_min_mb=h.reshard_direct_min_mb)

    # --- one step -----------------------------------------------------------------------------
    def train_step(self, step: int, indices: list[int], next_batch) -> dict:
        """One RL step on the prompts `indices` (next_batch() supplies more for DAPO)."""
        timings, self.phase_peaks = {}, {}
        sync, phase = self.device.type == "cuda", self._phase
        with timer("step", timings, sync):
            with phase("rollout"):
                batch, gen_metrics = self.collector.collect(indices, next_batch, step,
                                                            self.train_ds)
            if batch is not None and not any(batch.response_ids):
                # Every response ended at its first token: no token to score or train on.
                if self.rank == 0:
                    print(f"warning: step {step}: all {len(batch)} responses are empty; "
                          f"nothing to train on, update skipped", flush=True)
                batch, gen_metrics["response_length/mean"] = None, 0.0
            if batch is None:              # DAPO: no informative group within the budget
                return self._gc_after(step, {**gen_metrics, **self.generator.pop_metrics(),
                                             **self.residency.pop_metrics()})
            # verl's critic warm-up: the actor updates once step >= trainer.critic_warmup
            update_actor = step >= self.cfg.trainer.critic_warmup
            old_from_update = update_actor and self._old_logprob_from_update(len(batch))
            own = self.actor.first_mini_batch(len(batch), self._n, step) if old_from_update else []
            old_scored = self._score(batch, timings, sync, own)
            with phase("adv", timings, sync):
                kl_metrics = self._advantages(batch)
                if not old_from_update and not self.bypass:
                    # pi_old / pi_rollout importance weights on the whole batch (verl: same phase);
                    # with pi_old from the update no weights are asked, and the drift metrics
                    # come from the actor's update (rl.roles)
                    kl_metrics.update(apply_rollout_correction(batch, self.rollout_correction))
            out = {}
            if self.interleaved and update_actor:    # critic first in each turn, as verl's order
                with phase(INTERLEAVED, timings, sync):
                    for m in round_robin([self.critic.updating(batch, self._n, step),
                                          self.actor.updating(batch, self._n, step,
                                                              old_from_update)]):
                        out.update(metrics_as_floats(m))       # after both: one host sync
            elif self.critic is not None:
                with phase("update_critic", timings, sync):
                    out.update(self.critic.update(batch, self._n, step))
            if update_actor and not self.interleaved:
                with phase("update_actor", timings, sync):
                    out.update(self.actor.update(batch, self._n, step, old_from_update))
            out["training/nan_skipped_updates"] = skipped_updates(
                out, {"critic": self.critic, "actor": self.actor}, len(batch), self._n,
                self.cfg.trainer.nan_policy, step, self.rank)
            self._finish_schedules(update_actor)
        # the actor's rollout_corr/ (pi_theta per micro-batch) over the batch's, as verl merges
        out = {**gen_metrics, **kl_metrics, **out, **self.generator.pop_metrics(),
               **self.residency.pop_metrics()}
        out.update({f"timing_s/{k}": v for k, v in timings.items()})
        out.update({f"perf/max_memory_allocated_gb/{k}": v / 2**30
                    for k, v in self.phase_peaks.items()})
        out.update(batch_metrics(batch, self.critic is not None, probs_diff=not self.bypass))
        out.update(self._perf(batch, timings, old_scored))
        return self._gc_after(step, out)

    def _gc_after(self, step: int, out: dict) -> dict:
        return {**out, **self.gc_freeze.after_step(step, out.get("timing_s/compile", 0.0))}

    @property
    def _n(self) -> int:
        return self.cfg.actor_rollout_ref.rollout.n

    @contextlib.contextmanager
    def _phase(self, name: str, timings: dict | None = None, sync: bool = False):
        """Phase `name` (guards.Phases: named in failures, timed when `timings`), with each
        role's offloaded parts moved where the phase needs them first (rl.residency); a
        profiler range of that name (tools/profiling.py). On CUDA its device peak goes to
        phase_peaks[name] (device_memory's window: from after the moves in, so that a phase's
        peak is what it holds and computes, comparable to the plan's phase)."""
        with self.phases.enter(name):
            self.residency.enter(name)
        cuda = self.device.type == "cuda"
        if cuda:
            start_window(self.device)
        with self.phases.enter(name, timings, sync), record_function(name):
            yield
        if cuda:
            self.phase_peaks[name] = window_peak(self.device)

    def _old_logprob_from_update(self, num_sequences: int) -> bool:
        """Nothing before the update reads pi_old (no KL in the reward, no rollout importance
        weights): the update's first mini-batch (Actor.first_mini_batch) takes its rows' pi_old from
        its own forward, the weights not yet moved, and the old-log-prob forward skips them;
        on-policy (one mini-batch, one epoch) all of them, as verl's dp_actor does (ratio 1).
        Bypass mode: pi_old is pi_rollout, but on-policy verl's actor takes its own forward's."""
        if self.bypass:
            return self.actor.on_policy(num_sequences, self._n)
        return not self.rollout_correction.reads_pi_old_first(self.cfg.algorithm.use_kl_in_reward)

    def _score(self, batch: Batch, timings, sync, own_rows: Sequence[int] = ()) -> list[int]:
        """The forward-only passes; the old-log-prob one over the rows not in own_rows (zeros
        here: the actor update's own forward fills them). Returns the rows it scored."""
        phase, own = self._phase, set(own_rows)
        rest = [i for i in range(len(batch)) if i not in own]
        if self.bypass:     # no old-log-prob forward: pi_old = pi_rollout (the KL in the reward's)
            batch.tensors["old_logprob"] = bypass_old_logprob(batch)
            rest = []
        elif own:
            batch.tensors["old_logprob"] = torch.zeros(len(batch), batch.max_response_length)
        if rest:
            with phase("old_log_prob", timings, sync):
                old = self.actor.score(batch.select(rest) if own else batch, "logprob")
                if own:
                    batch.tensors["old_logprob"][torch.tensor(rest, dtype=torch.long)] = old
                else:
                    batch.tensors["old_logprob"] = old
        if self.ref is not None:
            with phase("ref", timings, sync):
                batch.tensors["ref_logprob"] = self.ref.score(batch, "logprob")
        if self.critic is not None:
            with phase("values", timings, sync):
                batch.tensors["values"] = self.critic.score(batch, "values")
        return rest

    def _advantages(self, batch: Batch) -> dict:
        alg, t = self.cfg.algorithm, batch.tensors
        mask = batch.response_mask
        metrics = {}
        if alg.use_kl_in_reward:
            t["token_level_rewards"], metrics = apply_kl_penalty(
                t["token_level_scores"], t["old_logprob"], t["ref_logprob"], mask,
                self.kl_ctrl, alg.kl_penalty)
        else:
            t["token_level_rewards"] = t["token_level_scores"]
        adv, ret = get_adv_estimator(alg.adv_estimator)(
            t["token_level_rewards"], mask, values=t.get("values"), group_index=batch.group,
            gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            reward_baselines=t.get("reward_baselines"))
        t["advantages"], t["returns"] = adv, ret
        return metrics

    def _finish_schedules(self, actor_updated: bool = True):
        if actor_updated:
            self.actor.engine.optimizer.step_schedule()
        if self.critic is not None:
            self.critic.engine.optimizer.step_schedule()

    def _perf(self, batch: Batch, timings: dict, old_scored: list[int]) -> dict:
        seqlens, resp = batch.seqlens, [len(r) for r in batch.response_ids]
        of = lambda rows: step_flops(                          # noqa: E731  these rows' FLOPs
            self.actor.engine.cfg, [seqlens[i] for i in rows], self.cfg, self.ref is not None,
            self.critic is not None, sum(resp[i] for i in rows))
        flops = of(range(len(batch)))
        if INTERLEAVED in timings:
            flops[INTERLEAVED] = flops.pop("update_critic") + flops.pop("update_actor")
        if 0 < len(old_scored) < len(batch):       # the update's forward gave the rest
            flops["old_log_prob"] = of(old_scored)["old_log_prob"]
        flops = {p: f for p, f in flops.items() if p in timings}     # the phases that ran
        return perf_metrics(batch, timings, flops, self.world, self.peak, self.device)

    # --- validation ---------------------------------------------------------------------------
    def validate(self) -> dict:
        if self.val_ds is None:
            return {}
        return self.collector.validate(self.val_ds)

    # --- checkpoints (rl.checkpointing) -------------------------------------------------------
    def save(self, step: int) -> Path:
        return self.checkpoints.save(step)

    def resume(self) -> int:
        t = self.cfg.trainer
        return self.checkpoints.resume(t.resume_mode, t.resume_from_path)

    # --- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to trainer.total_training_steps; the directory lock is released however it ends."""
        try:
            return self._fit()
        finally:
            self.gc_freeze.close()
            if self.run_lock is not None:
                self.run_lock.release()

    def _fit(self) -> dict:
        t, phase = self.cfg.trainer, self._phase
        with phase("resume"):
            start = self.resume()
        if self.rank == 0:
            print("\n".join(header_lines(RunFacts.of(self, start))), flush=True)
            critic = self.critic.engine.cfg if self.critic is not None else None
            print("\n".join(memory_report(self.cfg, self.layout, self.actor.engine.cfg, critic,
                                           self.device)), flush=True)
        tracker = Tracker(t.logger, self.root, t.project_name, t.experiment_name, self.rank,
                          resume_step=start if start else None, total_steps=self.total_steps)
        last_val = {}
        if start == 0 and t.val_before_train:
            with phase("validate"):
                last_val = self.validate()
            tracker.log(last_val, 0)
        step = start
        batches = iter(self.sampler)
        while step < self.total_steps:
            indices = next(batches, None)
            if indices is None:
                if self.rank == 0:
                    print(data_ran_out_line(step, self.total_steps, self.sampler), flush=True)
                break
            step = self.phases.step = step + 1
            inject_faults(step, self.rank, self.world)
            metrics = self.train_step(step, indices, lambda: next(batches, None))
            metrics["training/global_step"] = step
            is_last = step >= self.total_steps
            # verl's rule: a frequency <= 0 turns validation / checkpoints off
            if t.test_freq > 0 and (step % t.test_freq == 0 or is_last):
                with phase("validate"):
                    last_val = self.validate()
                metrics.update(last_val)
            tracker.log(metrics, step)
            if t.save_freq > 0 and (step % t.save_freq == 0 or is_last):
                with phase("save"):
                    self.save(step)
        summary = tracker.summary()
        tracker.close()
        self.residency.unpark_all()
        self.generator.close()          # a vLLM engine shuts down while the group still exists
        if self.rank == 0:
            done = f"{summary}\n" if summary else ""
            print(f"{done}metrics: {self.root / 'metrics.jsonl'}\ncheckpoints: {self.root}",
                  flush=True)
        return last_val
