"""The SmolLM2 recipes: the arithmetic data (tools/data/arith.py), its reward
(tools/rewards/arith.py) and the three configs (they load and pass the cross-field checks)."""
import importlib.util
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hybridengine.config import load_config, validate_config
from hybridengine.rl.data import load_rows
from hybridengine.rl.rewards import load_custom_reward, score_batch

REPO = Path(__file__).resolve().parents[1]
REWARD = REPO / "tools/rewards/arith.py"


def _module(rel):
    spec = importlib.util.spec_from_file_location(Path(rel).stem + "_tool", REPO / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


arith = _module("tools/data/arith.py")


def _key(row):
    info = row["extra_info"]
    return info["kind"], info["a"], info["b"]


def test_splits_are_seeded_balanced_and_disjoint(tmp_path):
    arith.main(["--local_dir", str(tmp_path), "--train_size", "2000", "--test_size", "500"])
    train = load_rows(tmp_path / "train.parquet")         # the trainer's own validation
    test = load_rows(tmp_path / "test.parquet")
    assert len(train) == 2000 and len(test) == 500
    assert pq.read_table(tmp_path / "test.parquet").to_pylist() == test
    assert arith.make_splits(2000, 500, seed=0) == {"train": train, "test": test}
    assert arith.make_splits(2000, 500, seed=1)["test"] != test
    assert len({_key(r) for r in test}) == 500
    assert not {_key(r) for r in train} & {_key(r) for r in test}
    for rows in (train, test):
        kinds = [r["extra_info"]["kind"] for r in rows]
        assert {k: kinds.count(k) for k in arith.KINDS} == dict.fromkeys(arith.KINDS,
                                                                         len(rows) // 5)
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
    row = test[0]
    kind, a, b = _key(row)
    op = arith.KINDS[kind][0]
    assert row["prompt"] == [{"role": "user",
                              "content": f"What is {a} {op} {b}? Answer with just the number."}]
    assert row["data_source"] == "arith"
    assert row["reward_model"]["ground_truth"] == str(arith.OPS[op](a, b))
    differences = [int(r["reward_model"]["ground_truth"]) for r in test
                   if r["extra_info"]["kind"] == "2d-2d"]
    assert min(differences) < 0 < max(differences)


@pytest.mark.parametrize("response,score", [
    ("140", 1.0), ("140<|im_end|>", 1.0), ("The answer is 140.", 1.0), (" 140\n", 1.0),
    ("47 + 93 = 140", 0.0), ("14", 0.0), ("1400", 0.0), ("", 0.0), ("one hundred forty", 0.0),
])
def test_reward_first_integer(response, score):
    fn = load_custom_reward(REWARD)
    assert fn(data_source="arith", solution_str=response, ground_truth="140",
              extra_info={}) == {"score": score, "acc": score}


def test_reward_signs_and_commas():
    fn = load_custom_reward(REWARD)
    scores, extras = score_batch(["-67", "\u221267", "67", "1,998", "1998 apples", "x-67"],
                                 ["arith"] * 6, ["-67", "-67", "-67", "1998", "1998", "-67"],
                                 fn=fn)
    assert scores == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0] and extras["acc"] == scores


@pytest.mark.parametrize("recipe,critic,ref", [("arith_smollm2", False, True),
                                               ("arith_smollm2_ppo", True, False),
                                               ("gsm8k_smollm2", False, True)])
def test_recipes_load(recipe, critic, ref, monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    cfg = load_config(["--config", str(REPO / "configs" / f"{recipe}.yaml")])
    layout = validate_config(cfg, world_size=1)
    assert (layout.critic is not None, layout.ref is not None) == (critic, ref)
    assert cfg.actor_rollout_ref.model.path == cfg.critic.model.path == "/home/u/smollm2/hf"
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.actor_rollout_ref.actor.megatron.param_dtype == "bfloat16"
    assert cfg.trainer.device == "auto"
    if recipe.startswith("arith"):
        assert cfg.data.train_batch_size == 64 and cfg.data.max_response_length == 32
        # the rates measured on the GPU (bench/RESULTS.md 2026-12-01, sessions 11 and 12)
        lr = 1e-5 if recipe == "arith_smollm2" else 5e-6
        assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(lr)
        assert cfg.trainer.total_training_steps == 1000
        assert cfg.custom_reward_function.path == "tools/rewards/arith.py"
        assert cfg.actor_rollout_ref.rollout.val_kwargs.do_sample is False
    if recipe == "arith_smollm2":
        actor = cfg.actor_rollout_ref.actor
        assert (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == \
            (True, pytest.approx(0.001), "low_var_kl")
