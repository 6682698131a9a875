"""From prompts to a scored Batch: sampling parameters, generation rounds, rewards, DAPO's
overlong penalty and dynamic sampling, and validation.

Rewards are computed on every rank from the same decoded text (rule rewards are cheap and
deterministic), so no scores travel between ranks.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from hybridengine.hybrid.generator import Generated, padded_rows
from hybridengine.rl.advantages import dynamic_sampling_keep_mask, overlong_penalty
from hybridengine.rl.batch import Batch
from hybridengine.rl.rewards import score_batch
from hybridengine.rollout.sampling import SamplingParams


def stop_token_ids(tokenizer, model_dir) -> tuple[int, ...]:
    """EOS ids of the tokenizer and of the model's generation_config.json (chat models end turns
    with a token other than the tokenizer's EOS)."""
    import json
    from pathlib import Path
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))


def decode_texts(tokenizer, ids: list[list[int]]) -> list[str]:
    """tokenizer.batch_decode(ids, skip_special_tokens=True), the same strings. A Rust-backed
    tokenizer decodes the whole batch in one call of its backend, on all host cores, where
    transformers' batch_decode calls it once per sequence: a step's 256 responses of 256 tokens
    took ~24 ms that way on a 2-core host (9 ms in one call), inside the step's reward time.
    Taken only where transformers would return the backend's text unchanged (its own _decode,
    no clean-up of tokenization spaces); any other tokenizer decodes as before."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:             # pragma: no cover - transformers before 5
        TokenizersBackend = None
    backend = getattr(tokenizer, "_tokenizer", None)
    if TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend) and \
            type(tokenizer)._decode is TokenizersBackend._decode and \
            not tokenizer.clean_up_tokenization_spaces and hasattr(backend, "decode_batch"):
        lists = [x if isinstance(x, list) else [int(t) for t in x] for x in ids]
        return backend.decode_batch(lists, skip_special_tokens=True)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


class RolloutCollector:
    """rank: this process's rank (rank 0 prints a warning when the rollout ran in waves,
    hybrid.generator.SlotUse: at the first such step, and again only when what it says changes,
    so a run that always runs in waves says so once, not every step)."""

    def __init__(self, cfg, tokenizer, generator, reward_fn=None, rank: int = 0):
        self.cfg, self.tokenizer, self.generator = cfg, tokenizer, generator
        self.reward_fn = reward_fn
        self.rank, self._last_waves = rank, None
        self.stop_ids = stop_token_ids(tokenizer, cfg.actor_rollout_ref.model.path)
        self.max_resp = cfg.data.max_response_length

    def sampling(self, kw, seed: int, ignore_eos: bool = False) -> SamplingParams:
        """SamplingParams of the rollout section or its val_kwargs `kw`."""
        greedy = not kw.do_sample or kw.temperature == 0
        return SamplingParams(n=kw.n, temperature=0.0 if greedy else kw.temperature,
                              top_p=kw.top_p, top_k=kw.top_k, max_tokens=self.max_resp,
                              stop_token_ids=self.stop_ids, seed=seed,
                              ignore_eos=ignore_eos)

    def _generate(self, items: list[dict], params: SamplingParams) -> tuple[Batch, Generated]:
        """(the Batch of `items`' responses, the generator's Generated)."""
        gen = self.generator.generate([it["prompt_ids"] for it in items], params)
        n = params.n
        rep = lambda key: [it[key] for it in items for _ in range(n)]      # noqa: E731
        batch = Batch([it["prompt_ids"] for it in items for _ in range(n)], gen.response_ids,
                      [i for i in range(len(items)) for _ in range(n)], rep("data_source"),
                      rep("ground_truth"), rep("extra_info"), self.max_resp)
        batch.tensors["rollout_logprob"] = torch.from_numpy(
            padded_rows(gen.logprobs, self.max_resp, np.float32))
        return batch, gen

    @staticmethod
    def _gen_metrics(gen) -> dict:
        out = {"timing_s/gen": gen.seconds,
               "perf/gen_tokens_per_s": gen.num_generated_tokens / gen.seconds}
        return out if gen.slots is None else {**out, **gen.slots.metrics()}

    def _score(self, batch: Batch) -> dict[str, list]:
        texts = decode_texts(self.tokenizer, batch.response_ids)
        # each prompt once (its n samples share it), for batch rewards that read prompts
        first = {g: i for i, g in reversed(list(enumerate(batch.group)))}
        text = dict(zip(first, decode_texts(self.tokenizer,
                                            [batch.prompt_ids[i] for i in first.values()])))
        prompts = [text[g] for g in batch.group]
        scores, extras = score_batch(texts, batch.data_source, batch.ground_truth,
                                     batch.extra_info, fn=self.reward_fn, prompts=prompts)
        scores = torch.tensor(scores, dtype=torch.float32)
        rm = self.cfg.reward_model
        if rm.reward_manager == "dapo" and rm.overlong_buffer.enable:
            lens = [len(r) for r in batch.response_ids]
            scores = scores + overlong_penalty(lens, self.max_resp, rm.overlong_buffer.len,
                                               rm.overlong_buffer.penalty_factor).float()
        tls = torch.zeros(len(batch), self.max_resp)
        ends = torch.tensor([max(len(r), 1) - 1 for r in batch.response_ids])
        tls[torch.arange(len(batch)), ends] = scores
        batch.tensors["token_level_scores"] = tls
        extras["seq_reward"] = scores.tolist()
        return extras

    def greedy_baselines(self, items: list[dict], batch: Batch, params: SamplingParams) -> torch.Tensor:
        """ReMax's reward_baselines: the score of one greedy response per prompt of `items`
        (same generator, same reward path as the samples), [B] aligned with `batch` (whose group
        is the prompt's index in `items`: each prompt's n samples share its baseline)."""
        greedy = replace(params, n=1, temperature=0.0, top_p=1.0, top_k=-1)
        base, _ = self._generate(items, greedy)
        self._score(base)
        scores = base.tensors["token_level_scores"].sum(-1)          # [num prompts]
        return scores[torch.tensor(batch.group, dtype=torch.long)]

    def collect(self, indices: list[int], next_batch, step: int, dataset):
        """Generate and score the responses of a round's prompts (`indices`: data.gen_batch_size
        of them, train_batch_size unless DAPO over-samples). With DAPO's filter_groups, keep
        generating from the next rounds until train_batch_size informative groups are kept (or
        max_num_gen_batches rounds ran); the first train_batch_size kept groups train. Returns
        (Batch | None, metrics)."""
        rk, fg = self.cfg.actor_rollout_ref.rollout, self.cfg.algorithm.filter_groups
        kept, num_groups, rounds, metrics, t_reward = [], 0, 0, {}, 0.0
        need, t_gen_max, waves = self.cfg.data.train_batch_size, 0.0, None
        while indices is not None:
            rounds += 1
            params = self.sampling(rk, seed=self.cfg.trainer.seed * 1_000_003 + step * 997 + rounds,
                                   ignore_eos=rk.ignore_eos)
            items = [dataset[i] for i in indices]
            batch, gen = self._generate(items, params)
            metrics = self._gen_metrics(gen)
            waves = waves or (gen.slots.warning(rk.max_num_seqs) if gen.slots else None)
            t0 = time.perf_counter()
            extras = self._score(batch)
            t_reward += time.perf_counter() - t0
            if self.cfg.algorithm.adv_estimator == "remax":    # before filtering: select() keeps it
                t0 = time.perf_counter()
                batch.tensors["reward_baselines"] = self.greedy_baselines(items, batch, params)
                t_gen_max += time.perf_counter() - t0
            if not fg.enable:
                kept, num_groups = [batch], need
                break
            # a source whose reward lacks the metric (verl's gsm8k has no "acc") uses its reward
            metric = [m if m is not None else r for m, r in
                      zip(extras.get(fg.metric, extras["seq_reward"]), extras["seq_reward"])]
            keep = dynamic_sampling_keep_mask(batch.group, metric)
            idx = keep.nonzero().squeeze(-1).tolist()
            if idx:
                part = batch.select(idx)
                part.group = [g + 1_000_000 * rounds for g in part.group]
                kept.append(part)
                num_groups += len(set(part.group))
            if num_groups >= need or (fg.max_num_gen_batches > 0
                                      and rounds >= fg.max_num_gen_batches):
                break
            indices = next_batch()
        metrics.update({"timing_s/reward": t_reward, "train/num_gen_batches": rounds})
        if waves and waves != self._last_waves and self.rank == 0:
            print(f"warning: step {step}: {waves}", flush=True)    # the first round's
        self._last_waves = waves or self._last_waves
        if t_gen_max:
            metrics["timing_s/gen_max"] = t_gen_max
        if fg.enable and num_groups < need and self.rank == 0:
            why = f"in max_num_gen_batches={fg.max_num_gen_batches} rounds" \
                if indices is not None else "before the data ran out"
            # verl's DAPO trainer raises here; a long run trains on what it kept, and says so
            print(f"warning: step {step}: dynamic sampling kept {num_groups} of "
                  f"data.train_batch_size={need} groups {why}; the step trains on those (verl "
                  f"stops with an error: raise algorithm.filter_groups.max_num_gen_batches, 0 "
                  f"for no limit)", flush=True)
        if not kept:
            return None, metrics
        batch = Batch.concat(kept)
        groups = sorted(set(batch.group), key=batch.group.index)[:need]
        keep = [i for i, g in enumerate(batch.group) if g in set(groups)]
        batch = batch.select(keep)
        renumber = {g: i for i, g in enumerate(groups)}
        batch.group = [renumber[g] for g in batch.group]
        return batch, metrics

    def validate(self, dataset) -> dict:
        """Mean reward (and accuracy when the reward reports it) per data source on the whole
        validation set, with actor_rollout_ref.rollout.val_kwargs. Grouped by the rows'
        data_source column (verl's _validate), not by the reward_fn_key column that chose each
        row's reward (the same by default)."""
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        items = [dataset[i] for i in range(len(dataset))]
        batch, _ = self._generate(items, self.sampling(vk, seed=self.cfg.trainer.seed))
        self._score(batch)
        scores = batch.tensors["token_level_scores"].sum(-1)
        out, sources = {}, [items[g]["metrics_source"] for g in batch.group]
        for ds in sorted(set(sources)):
            sel = torch.tensor([d == ds for d in sources])
            out[f"val/test_score/{ds}"] = scores[sel].mean().item()
        out["val/reward/mean"] = scores.mean().item()
        out["val/response_length/mean"] = float(
            sum(len(r) for r in batch.response_ids) / len(batch))
        return out
