"""Actor, critic and reference: a TrainEngine each, plus RL micro-batching and losses.

Roles see the whole step's Batch on every rank; each splits it over its own data-parallel group
(token-balanced), packs micro-batches, and returns per-response-token results as [B, R] tensors
on every rank. Loss normalisers are global (the whole mini-batch over all DP ranks and
micro-batches), so gradient sums over DP equal a single-process run (see rl.losses).
"""
from __future__ import annotations

from collections.abc import Sized

import torch

from hybridengine.config.run import ActorConfig, ActorRolloutRefConfig, CriticConfig, \
    MegatronSection, OptimSection, RefConfig
from hybridengine.parallel.interleave import run_to_end
from hybridengine.parallel.lora import adapters_disabled
from hybridengine.parallel.pipeline import broadcast_from_last_stage
from hybridengine.train.engine import OptimConfig, TrainEngine
from hybridengine.rl.bypass import CORR_PREFIX, bypass_policy_loss
from hybridengine.rl.batch import Batch, build_microbatch, dp_shards, gather_response_tensor, \
    microbatch_plan
from hybridengine.rl.rollout_correction import RolloutCorrectionConfig, \
    compute_offpolicy_metrics, rollout_logprobs_known
from hybridengine.rl.masked_stats import metrics_as_floats
from hybridengine.rl.losses import GlobalBatchInfo, PolicyLossConfig, compute_entropy_loss, \
    compute_kl_loss, compute_value_loss, get_policy_loss_fn


def optim_config(optim: OptimSection, megatron: MegatronSection, grad_clip: float,
                 total_steps: int) -> OptimConfig:
    warmup = optim.lr_warmup_steps
    if warmup is None or warmup < 0:
        warmup = int((optim.lr_warmup_steps_ratio or 0.0) * total_steps)
    return OptimConfig(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                       grad_clip=grad_clip, warmup_steps=warmup, total_steps=total_steps,
                       schedule=optim.lr_scheduler_type, min_lr_ratio=optim.min_lr_ratio or 0.0,
                       use_distributed_optimizer=megatron.use_distributed_optimizer,
                       host_step=megatron.optimizer_offload == "host_step")


def policy_loss_config(actor: ActorConfig) -> PolicyLossConfig:
    """actor.clip_ratio_{low,high} (null: clip_ratio), clip_ratio_c and actor.policy_loss.*."""
    pick = lambda v: actor.clip_ratio if v is None else v      # noqa: E731
    p = actor.policy_loss
    return PolicyLossConfig(p.loss_mode, pick(actor.clip_ratio_low), pick(actor.clip_ratio_high),
                            actor.clip_ratio_c, p.clip_cov_ratio, p.clip_cov_lb, p.clip_cov_ub,
                            p.kl_cov_ratio, p.ppo_kl_coef)


class Role:
    """Scoring (forward-only) shared by all roles."""

    # seq-mean-token-sum-norm's divisor, one constant for every micro-batch; None: the response
    # width, data.max_response_length (Batch.max_response_length)
    loss_scale_factor: float | None = None

    def __init__(self, engine: TrainEngine, micro_batch_size, max_tokens, use_dynamic_bsz):
        self.engine, self.mesh = engine, engine.mesh
        self.micro_batch_size, self.max_tokens = micro_batch_size, max_tokens
        self.use_dynamic_bsz = use_dynamic_bsz

    def _plan(self, batch: Batch, micro: tuple | None = None):
        """micro = (micro_batch_size, max_tokens, use_dynamic_bsz); default: the scoring one."""
        size, max_tokens, dynamic = micro or (self.micro_batch_size, self.max_tokens,
                                              self.use_dynamic_bsz)
        return microbatch_plan(batch, dp_shards(batch, self.mesh.dp), size, max_tokens, dynamic)

    def _microbatches(self, batch, idx_lists, fields=()):
        dev = self.engine.device
        return [build_microbatch(batch, idx, self.mesh.tp, fields).to(dev, non_blocking=True)
                for idx in idx_lists]

    @torch.no_grad()
    def score(self, batch: Batch, key: str) -> torch.Tensor:
        """Per-response-token `key` ('logprob', 'entropy' or 'values') as [B, R] on every rank."""
        plan = self._plan(batch)
        mbs = self._microbatches(batch, plan[self.mesh.dp_rank])
        outs = self.engine.forward_only(mbs)
        return self._response_grid(batch, plan, mbs, [o[key] for o in outs])

    def _response_grid(self, batch: Batch, plan, mbs, per_token: list) -> torch.Tensor:
        """[B, R] on every rank from per-token results (one per micro-batch of this rank's
        `plan` entry, on every stage of the replica)."""
        local = [o[mb.tensors["resp_idx"]] * mb.tensors["resp_mask"]
                 for o, mb in zip(per_token, mbs)]
        return gather_response_tensor(local, plan, len(batch), batch.max_response_length,
                                      self.mesh, self.engine.device)

    def _mini_batches(self, batch: Sized, mini_size: int, epochs: int, shuffle: bool, seed: int):
        """Yield mini-batches (index lists of batch's sequences) for every epoch, reproducibly on
        every rank."""
        n = len(batch)
        for epoch in range(epochs):
            order = list(range(n))
            if shuffle:
                g = torch.Generator().manual_seed(seed * 1000 + epoch)
                order = torch.randperm(n, generator=g).tolist()
            for s in range(0, n, mini_size):
                yield order[s:s + mini_size]

    def _updating(self, batch: Batch, mini_size, epochs, shuffle, seed, micro, fields,
                  loss_builder, own_first: bool = False):
        """Mini-batch loop: one optimizer step per mini-batch; returns averaged metrics. A unit
        of parallel.interleave (yields between micro-batches: TrainEngine.train_steps).
        loss_builder(info, scale, own) makes a mini-batch's loss; own is True for the first
        mini-batch of the first epoch when own_first: the weights have not moved yet, so its
        forward is pi_old, and its log-probs (detached, before the step) fill those rows of
        batch.tensors["old_logprob"] ([B, R] on every rank, which must be there)."""
        def packed(idx):      # host work: done for mini-batch k + 1 during k's backward
            mini = batch.select(idx)
            plan = self._plan(mini, micro)
            return mini, plan, self._microbatches(mini, plan[self.mesh.dp_rank], fields)

        all_metrics: list[dict] = []
        own_rows = None
        minis = list(self._mini_batches(batch, mini_size, epochs, shuffle, seed))
        ready = [packed(minis[0])]
        for k, idx in enumerate(minis):
            mini, plan, mbs = ready.pop()
            scale_factor = mini.max_response_length if self.loss_scale_factor is None \
                else self.loss_scale_factor
            info = GlobalBatchInfo.of(mini.response_mask, scale_factor)
            scale = len(mbs) * self.mesh.dp      # metrics: mean over (mb, dp) x scale = sum
            kept: list[torch.Tensor] = []
            own = own_first and k == 0
            loss_fn = loss_builder(info, scale, own)
            if own:
                loss_fn = _keeping_logprobs(loss_fn, kept)
            # a next mini-batch that holds rows of this one (one mini-batch an epoch) is packed
            # after their pi_old is written below
            pack_after = own and k + 1 < len(minis) and not set(minis[k + 1]).isdisjoint(idx)
            pack_next = (lambda i=k + 1: ready.append(packed(minis[i]))) \
                if k + 1 < len(minis) and not pack_after else None
            all_metrics.append((yield from self.engine.train_steps(
                mbs, loss_fn, before_step=pack_next, metrics_on_device=True)))
            if own:
                own_rows = (idx, mini, plan, mbs, kept)
                # the host grid waits for the device (a sync): written once every mini-batch is
                # queued, unless a later one holds these rows (more epochs) and packs them
                if any(not set(m).isdisjoint(idx) for m in minis[k + 1:]):
                    self._write_old_logprob(batch, *own_rows)
                    own_rows = None
            if pack_after:
                ready.append(packed(minis[k + 1]))
        if own_rows is not None:
            self._write_old_logprob(batch, *own_rows)
        return _mean_metrics(all_metrics)

    def _write_old_logprob(self, batch: Batch, idx, mini, plan, mbs, kept) -> None:
        """batch.tensors["old_logprob"][idx] from the log-probs `kept` of mini-batch `idx`'s
        own forward (every stage and DP rank gets them)."""
        kept = broadcast_from_last_stage(kept, [mb.num_tokens for mb in mbs], self.mesh,
                                         device=self.engine.device)
        batch.tensors["old_logprob"][torch.tensor(idx, dtype=torch.long)] = \
            self._response_grid(mini, plan, mbs, kept)


class Actor(Role):
    def __init__(self, engine: TrainEngine, cfg: ActorRolloutRefConfig,
                 correction: RolloutCorrectionConfig = RolloutCorrectionConfig()):
        a, r = cfg.actor, cfg.rollout
        super().__init__(engine, r.log_prob_micro_batch_size_per_gpu,
                         r.log_prob_max_token_len_per_gpu, r.log_prob_use_dynamic_bsz)
        self.cfg, self.loss_agg_mode = a, a.loss_agg_mode
        self.loss_scale_factor = a.loss_scale_factor
        self.policy_loss = policy_loss_config(a)
        # bypass mode: pi_old is pi_rollout and verl's bypass-mode loss replaces loss_mode's
        self.bypass = correction.bypass_mode
        self.policy_loss_fn = bypass_policy_loss(correction, correction.loss_type) \
            if self.bypass else get_policy_loss_fn(self.policy_loss.loss_mode)

    def on_policy(self, num_sequences: int, n: int) -> bool:
        """One mini-batch (the whole batch) and one epoch: verl's dp_actor then takes pi_old
        from the update's own forward."""
        a = self.cfg
        return a.ppo_epochs == 1 and a.ppo_mini_batch_size * n >= num_sequences

    def first_mini_batch(self, num_sequences: int, n: int, seed: int) -> list[int]:
        """The sequences of update(seed)'s first optimizer step (all of them with one mini-batch
        and one epoch): their pi_old is the policy that step starts from, which its own forward
        computes."""
        a = self.cfg
        return next(self._mini_batches(range(num_sequences), a.ppo_mini_batch_size * n,
                                       a.ppo_epochs, a.shuffle, seed))

    def update(self, batch: Batch, n: int, seed: int, old_from_update: bool = False) -> dict:
        return metrics_as_floats(run_to_end(self.updating(batch, n, seed, old_from_update)))

    def updating(self, batch: Batch, n: int, seed: int, old_from_update: bool = False):
        """One PPO update, a unit of parallel.interleave; returns its metrics, still on the
        device (metrics_as_floats reads them).
        old_from_update: the first mini-batch (first_mini_batch's rows) takes pi_old from its
        own forward, detached (the ratio is 1, as verl's dp_actor does on-policy, where that
        mini-batch is the whole batch), and fills those rows of batch.tensors["old_logprob"],
        which the caller left unscored, zeros (Trainer._score; the metrics that compare pi_old
        with the rollout's log-probs read them after the update)."""
        a = self.cfg
        # verl's actor logs pi_theta against pi_rollout per micro-batch (in bypass mode its loss)
        drift = not self.bypass and rollout_logprobs_known(batch)
        fields = ("old_logprob", "advantages") + (("ref_logprob",) if a.use_kl_loss else ()) \
            + (("rollout_is_weights",) if "rollout_is_weights" in batch.tensors else ()) \
            + (("rollout_logprob",) if drift else ())
        micro = (a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu, a.use_dynamic_bsz)
        # clip_cov's random token subset: seeded by the step, drawn in the same order on every
        # TP rank of a replica (the same micro-batches, the same log-probs)
        generator = torch.Generator().manual_seed(seed)
        m = yield from self._updating(
            batch, a.ppo_mini_batch_size * n, a.ppo_epochs, a.shuffle, seed, micro, fields,
            lambda info, scale, own: self._loss(info, scale, generator, own, drift),
            own_first=old_from_update)
        return {k if k.startswith(CORR_PREFIX) else f"actor/{k}": v for k, v in m.items()}

    def _loss(self, info: GlobalBatchInfo, scale: int, generator: torch.Generator,
              on_policy: bool, drift: bool = False):
        a, mode = self.cfg, self.loss_agg_mode
        agg = (info.normalizer(mode), info.loss_scale_factor)

        def loss_fn(out, mb):
            t, mask = mb.tensors, mb.tensors["resp_mask"]
            logp, ent = out["logprob"][t["resp_idx"]], out["entropy"][t["resp_idx"]]
            old = logp.detach() if on_policy else t["old_logprob"]
            # metrics: verl's names less "actor/" (update() adds it); per mode, see rl.losses
            pg_loss, pg_metrics = self.policy_loss_fn(
                old, logp, t["advantages"], mask, mode, self.policy_loss, info,
                rollout_is_weights=t.get("rollout_is_weights"), generator=generator)
            ent_loss = compute_entropy_loss(ent, mask, mode, *agg)
            loss = pg_loss - a.entropy_coeff * ent_loss
            metrics = {"pg_loss": pg_loss.detach() * scale, **pg_metrics,
                       "entropy": ent_loss.detach() * scale}
            if drift:
                metrics.update({CORR_PREFIX + k: v for k, v in compute_offpolicy_metrics(
                    logp.detach(), t["rollout_logprob"], mask).items()})
            if a.use_kl_loss:
                kl = compute_kl_loss(logp, t["ref_logprob"], mask, a.kl_loss_type, mode, *agg)
                loss = loss + a.kl_loss_coef * kl
                metrics.update(kl_loss=kl.detach() * scale, kl_coef=a.kl_loss_coef)
            return loss, metrics
        return loss_fn


class Critic(Role):
    def __init__(self, engine: TrainEngine, cfg: CriticConfig, loss_agg_mode: str):
        super().__init__(engine, cfg.forward_micro_batch_size_per_gpu,
                         cfg.forward_max_token_len_per_gpu, cfg.use_dynamic_bsz)
        self.cfg, self.loss_agg_mode = cfg, loss_agg_mode

    def update(self, batch: Batch, n: int, seed: int) -> dict:
        return metrics_as_floats(run_to_end(self.updating(batch, n, seed)))

    def updating(self, batch: Batch, n: int, seed: int):
        """One value update, a unit of parallel.interleave; returns its metrics, still on the
        device (metrics_as_floats reads them)."""
        c = self.cfg
        micro = (c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu, c.use_dynamic_bsz)
        m = yield from self._updating(
            batch, c.ppo_mini_batch_size * n, c.ppo_epochs, c.shuffle, seed, micro,
            ("values", "returns"), lambda info, scale, _own: self._loss(info, scale))
        return {f"critic/{k}": v for k, v in m.items()}

    def _loss(self, info: GlobalBatchInfo, scale: int):
        def loss_fn(out, mb):
            t, mask = mb.tensors, mb.tensors["resp_mask"]
            vpreds = out["values"][t["resp_idx"]]
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds, t["returns"], t["values"], mask, self.cfg.cliprange_value,
                self.loss_agg_mode, info.normalizer(self.loss_agg_mode), info.loss_scale_factor)
            return vf_loss, {"vf_loss": vf_loss.detach() * scale, "vf_clipfrac": vf_clipfrac}
        return loss_fn


class Reference(Role):
    """The reference policy: an engine of its own, or with base_of_actor the actor's engine with
    its LoRA adapters switched off (verl's ref_in_actor: no second copy of the weights)."""

    def __init__(self, engine: TrainEngine, cfg: RefConfig, base_of_actor: bool = False):
        super().__init__(engine, cfg.log_prob_micro_batch_size_per_gpu,
                         cfg.log_prob_max_token_len_per_gpu, cfg.log_prob_use_dynamic_bsz)
        self.base_of_actor = base_of_actor

    def score(self, batch: Batch, key: str) -> torch.Tensor:
        if not self.base_of_actor:
            return super().score(batch, key)
        with adapters_disabled(self.engine.model):
            return super().score(batch, key)


INTERLEAVED = "update_critic_actor"     # the trainer's phase of the two updates interleaved


def interleave_off(actor: Actor, critic: Critic | None) -> str | None:
    """Why the critic's and actor's updates cannot run interleaved (parallel.interleave), None
    where they can: both roles' parts stay on the device through both updates, and no capture
    of training CUDA graphs (in a role's step, before its first forward) falls between the
    other role's micro-batches."""
    if critic is None:
        return "no critic"
    for name, engine in (("actor", actor.engine), ("critic", critic.engine)):
        if engine.offload:
            return f"the {name} offloads its {', '.join(engine.offload)} between phases"
        if engine.graphs is not None:
            return f"the {name} trains in CUDA graphs"
    return None


def _keeping_logprobs(loss_fn, kept: list):
    """loss_fn that also appends each micro-batch's per-token log-probs (detached) to `kept`."""
    def keeping(out, mb):
        kept.append(out["logprob"].detach())
        return loss_fn(out, mb)
    return keeping


def _mean_metrics(per_step: list[dict]) -> dict:
    """Each key's mean over the optimizer steps, still on the device where the steps' are (no
    host sync before every update of a step has been queued: metrics_as_floats reads them)."""
    return {k: sum(m[k] for m in per_step) / len(per_step) for k in per_step[0]}
