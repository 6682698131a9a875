"""trainer.interleave_updates: the critic's and the actor's updates queued a micro-batch of each
in turn (parallel.interleave) train exactly as one after the other, on every layout, and run
one after the other where a role offloads or trains in CUDA graphs."""
import json
from pathlib import Path

import pytest
import torch

from dist_utils import run_dist
from hybridengine.parallel.interleave import round_robin, run_to_end
from hybridengine.rl.tracking import read_metrics
from test_offload import tiny_ppo_trainer


def _unit(name, steps, log):
    for i in range(steps):
        log.append((name, i))
        yield
    return f"{name} done"


def test_round_robin_takes_turns_and_returns_each_result():
    log = []
    out = round_robin([_unit("critic", 4, log), _unit("actor", 2, log)])
    assert out == ["critic done", "actor done"]
    assert log == [("critic", 0), ("actor", 0), ("critic", 1), ("actor", 1), ("critic", 2),
                   ("critic", 3)]
    assert run_to_end(_unit("alone", 3, log)) == "alone done" and log[-1] == ("alone", 2)


def _fit(rank, world, out_dir, overrides):
    """tiny_ppo_trainer, 2 responses a prompt and 2 mini-batches an update, fitted; the order
    in which the roles' training micro-batches ran goes to order.json."""
    trainer = tiny_ppo_trainer(world, out_dir, "actor_rollout_ref.rollout.n=2",
                               "critic.ppo_mini_batch_size=4", *overrides)
    order = []
    for name, role in (("actor", trainer.actor), ("critic", trainer.critic)):
        forward = role.engine._stage_outputs

        def recording(*args, name=name, forward=forward):
            if torch.is_grad_enabled():         # training micro-batches, not the scoring ones
                order.append(name)
            return forward(*args)
        role.engine._stage_outputs = recording
    trainer.fit()
    weights = {f"{role}.{n}": p.detach().clone()
               for role, eng in (("actor", trainer.actor.engine), ("critic", trainer.critic.engine))
               for n, p in eng.model.named_parameters()}
    torch.save(weights, Path(out_dir) / f"weights_{rank}.pt")
    if rank == 0:
        (Path(out_dir) / "order.json").write_text(json.dumps(order))


# The critic tp=2 + SP in micro-batches of 2 sequences; the actor's of 4, so the turns end with
# the critic's. "dp": the actor tp=1 dp=2 (its gradients reduced across the ranks in turn with
# the critic's TP collectives); "pp": the actor's 2 stages (a 1F1B schedule runs whole: a turn
# is an optimizer step).
_A = "actor_rollout_ref.actor."
LAYOUTS = {
    "dp": [_A + "megatron.tensor_model_parallel_size=1"],
    "pp": [_A + "megatron.tensor_model_parallel_size=1",
           _A + "megatron.pipeline_model_parallel_size=2",
           "critic.megatron.pipeline_model_parallel_size=1"]}
COMMON = ["critic.megatron.tensor_model_parallel_size=2", _A + "ppo_micro_batch_size_per_gpu=4",
          "critic.ppo_micro_batch_size_per_gpu=2"]


def _fit_both(rank, world, tmp, layout):
    overrides = COMMON + LAYOUTS[layout]
    _fit(rank, world, f"{tmp}/sequential", overrides)
    _fit(rank, world, f"{tmp}/interleaved", overrides + ["trainer.interleave_updates=true"])


def _training_metrics(path):
    return [{k: v for k, v in r.items()
             if not k.startswith(("timing_s/", "perf/")) and "memory" not in k}
            for r in read_metrics(path / "metrics.jsonl")]


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_interleaved_updates_train_exactly_as_sequential(tmp_path, layout):
    run_dist(_fit_both, 2, str(tmp_path), layout)
    seq, inter = tmp_path / "sequential", tmp_path / "interleaved"
    assert _training_metrics(seq) == _training_metrics(inter)
    for rank in range(2):
        a, b = torch.load(seq / f"weights_{rank}.pt"), torch.load(inter / f"weights_{rank}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a step: 16 sequences, 2 mini-batches of 8 an update; the critic (dp 1) runs 4 micro-
    # batches of 2 a mini-batch. dp: the actor (dp 2) 1 of 4 a mini-batch on each rank, a turn
    # each (a role's next mini-batch follows its optimizer step), then the critic's 6 more.
    # pp: the actor (dp 1) 2 of 4 a mini-batch, both in one turn.
    actor = 2 if layout == "dp" else 4
    assert json.loads((seq / "order.json").read_text()) == \
        (["critic"] * 8 + ["actor"] * actor) * 2
    turn = ["actor"] * (actor // 2)
    assert json.loads((inter / "order.json").read_text()) == \
        (["critic", *turn, "critic", *turn] + ["critic"] * 6) * 2
    m_seq, m_inter = (read_metrics(d / "metrics.jsonl")[0] for d in (seq, inter))
    assert "timing_s/update_critic_actor" in m_inter and "perf/mfu/update_critic_actor" in m_inter
    assert "timing_s/update_actor" not in m_inter and "timing_s/update_critic" not in m_inter
    assert "timing_s/update_critic_actor" not in m_seq and "timing_s/update_actor" in m_seq


def test_a_role_that_offloads_updates_one_after_the_other_and_says_why(tmp_path):
    from hybridengine.rl.console import RunFacts
    from test_temperature import tiny_trainer
    asked = ["algorithm.adv_estimator=gae", "trainer.interleave_updates=true",
             "critic.ppo_micro_batch_size_per_gpu=4"]
    trainer = tiny_trainer(tmp_path / "offload", *asked, "critic.megatron.grad_offload=true")
    assert not trainer.interleaved
    assert RunFacts.of(trainer, 0).updates == \
        "one after the other (not interleaved: the critic offloads its grads between phases)"
    m = trainer.train_step(1, [0, 1, 2, 3], lambda: None)
    assert "timing_s/update_critic" in m and "timing_s/update_critic_actor" not in m

    trainer = tiny_trainer(tmp_path / "asked", *asked)
    assert trainer.interleaved and RunFacts.of(trainer, 0).updates == \
        "critic and actor interleaved, a micro-batch of each in turn"
    assert RunFacts.of(tiny_trainer(tmp_path / "grpo", asked[1]), 0).updates == \
        "one after the other (not interleaved: no critic)"
    assert RunFacts.of(tiny_trainer(tmp_path / "off", asked[0], asked[2]), 0).updates is None


def _master(trainer, role):
    """The role's fp32 master weights (one rank: all of them), flat."""
    return torch.cat([b.master.float() for b in getattr(trainer, role).engine.optimizer.buckets])


def _close(got, want, tol):
    return abs(got - want) <= tol * max(abs(want), 1e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_interleaved_updates_of_one_batch_match_sequential(tmp_path, device):
    """Two trainers update on the same batches (the sequential one's rollouts, copied), one
    after the other and interleaved. CPU: exactly. CUDA (bf16, the CUDA defaults: compiled layers,
    token-budget micro-batches): flash attention's backward may sum in any order, so within 1%."""
    import copy
    from test_temperature import tiny_trainer
    run = ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", f"trainer.device={device}",
           "actor_rollout_ref.actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2"]
    if device == "cuda":
        run += [f"{role}.megatron.param_dtype=bfloat16"
                for role in ("actor_rollout_ref.actor", "critic")]
        run += ["actor_rollout_ref.rollout.dtype=bfloat16"]
    seq = tiny_trainer(tmp_path / "seq", *run)
    inter = tiny_trainer(tmp_path / "inter", *run, "trainer.interleave_updates=true")
    assert inter.interleaved and not seq.interleaved
    batches, collect = [], seq.collector.collect

    def recording(*args):
        batch, metrics = collect(*args)
        batches.append(copy.deepcopy(batch))
        return batch, metrics
    seq.collector.collect = recording
    inter.collector.collect = lambda *args: (copy.deepcopy(batches[-1]), {})
    tol = 0.0 if device == "cpu" else 0.01
    start = {role: _master(seq, role).clone() for role in ("actor", "critic")}
    for step in (1, 2):
        m_seq = seq.train_step(step, [4 * step + i for i in range(4)], lambda: None)
        m_inter = inter.train_step(step, [4 * step + i for i in range(4)], lambda: None)
        trained = [k for k in m_seq if k.startswith(("actor/", "critic/"))]
        assert len(trained) > 8 and "timing_s/update_critic_actor" in m_inter
        bad = [k for k in trained if not _close(m_inter[k], m_seq[k], tol)]
        assert not bad, [(k, m_seq[k], m_inter[k]) for k in bad]
    for role in ("actor", "critic"):
        # the fp32 master weights: bf16 weights may not move at all in two steps of the
        # critic's lr 1e-5 (a step below half a bf16 ulp rounds back to the same weight)
        a, b = _master(seq, role), _master(inter, role)
        moved = float((a - start[role]).norm())
        assert moved > 0, role
        err = float((b - a).norm()) / moved       # within tol of how far the sequential one moved
        assert not err > tol, (role, err)
