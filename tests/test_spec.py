"""resolve decides how each engine of a run runs and where its weights come from: build and the
trainer only follow the spec (otbrl.run.spec)."""

from __future__ import annotations

import pytest

from otbrl.config import load_config
from otbrl.run.spec import resolve


def test_each_engine_is_decided_from_the_config():
    spec = resolve(
        load_config(
            None,
            [
                "model.lora.rank=4", "model.lora.sync=adapter", "rollout.name=vllm",
                "model.precision=bf16-mixed", "actor.use_kl_loss=true", "critic.enable=true",
                "actor.micro_batch_size=3", "actor.max_tokens_per_micro_batch=512",
                "critic.micro_batch_size=5", "algorithm.distill.teacher_path=/teacher",
                "algorithm.distill.micro_batch_size=2", "rollout.n=2",
                "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
            ],
        )
    )  # fmt: skip
    e = spec.engines
    assert set(e) == {"policy", "critic", "reference", "teacher"}
    assert e["policy"].optim is not None and e["critic"].optim is not None
    assert e["reference"].optim is None and e["teacher"].optim is None
    assert e["policy"].mini_batch_size == e["critic"].mini_batch_size == 4 * 2
    # LoRA: the reference is the policy with its adapters off, the base frozen in bf16
    assert e["reference"].view and spec.model.dtype == "bfloat16"
    assert spec.model.adapter_dtype == "float32" and spec.serve_adapter
    # one road for micro-batches: each engine's own, the teacher's cap with the actor's budget
    micro = {name: (p.spec.micro.micro_batch_size, p.spec.micro.max_tokens_per_micro_batch)
             for name, p in e.items()}  # fmt: skip
    assert micro == {"policy": (3, 512), "reference": (3, 512), "critic": (5, None),
                     "teacher": (2, 512)}  # fmt: skip
    assert e["critic"].spec.value and e["critic"].dtype == "float32"  # fp32 master weights
    assert e["teacher"].path == "/teacher" and e["teacher"].spec.precision == "bf16-mixed"
    # a teacher without a precision of its own loads as the policy's weights do
    assert e["teacher"].dtype == spec.model.dtype
    assert spec.rollout_autocast == "bfloat16" and not spec.sync_at_start


@pytest.mark.parametrize(
    ("overrides", "sync"),
    [
        ([], False),
        (["rollout.name=vllm", "rollout.mode=server"], True),  # a user's server: other weights
        (["rollout.name=vllm"], False),
    ],
)
def test_the_rollout_is_synced_at_start_where_it_may_hold_other_weights(overrides, sync):
    spec = resolve(load_config(None, overrides))
    assert spec.sync_at_start is sync
    assert spec.model.warm_start is not None and spec.model.lora is None  # the built-in model


def test_a_teacher_in_its_own_precision_loads_frozen_weights():
    spec = resolve(
        load_config(
            None,
            ["algorithm.distill.teacher_path=/t", "algorithm.distill.precision=bf16-mixed"],
        )
    )
    teacher = spec.engines["teacher"]
    assert teacher.dtype == "bfloat16" and teacher.spec.precision == "bf16-mixed"
    assert spec.engines["policy"].dtype == "float32"  # the policy's own 32-true


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["algorithm.adv_estimator=grpo", "algorithm.otb.leave_one_out=true"],
         "algorithm.otb.leave_one_out"),
        (["algorithm.norm_adv_by_std_in_grpo=false"], "algorithm.norm_adv_by_std_in_grpo"),
        (["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.lam=0.9"], "algorithm.lam"),
        (["actor.kl_loss_coef=0.1"], "actor.kl_loss_coef"),
        (["actor.kl_loss_type=k1"], "actor.kl_loss_type"),
        (["algorithm.kl_coef=0.05"], "algorithm.kl_coef"),
    ],
)  # fmt: skip
def test_a_key_of_a_part_that_is_off_is_refused(overrides, key):
    """The configuration guide promises it; these were taken and changed nothing (Dr. GRPO's
    switch under OTB, OTB's options under GRPO, the KL weights with their KL off)."""
    from otbrl.config import ConfigError

    with pytest.raises(ConfigError) as err:
        resolve(load_config(None, overrides))
    assert err.value.key == key and "drop the key" in str(err.value), str(err.value)


def test_the_keys_of_a_part_that_is_on_are_taken():
    spec = resolve(
        load_config(
            None,
            [
                "algorithm.adv_estimator=gae", "algorithm.lam=0.9", "algorithm.gamma=0.99",
                "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.kl_loss_type=k1",
                "algorithm.use_kl_in_reward=true", "algorithm.kl_coef=0.05",
            ],
        )
    )  # fmt: skip
    assert spec.estimator_options["lam"] == 0.9 and spec.kl_in_reward_coef == 0.05
    assert spec.policy_loss["kl_loss_coef"] == 0.1
    # otbrl variance measures several estimators with one configuration: an option any of them
    # takes is used
    cfg = load_config(None, ["algorithm.norm_adv_by_std_in_grpo=false"])
    resolve(cfg, estimators=["optimal_token_baseline", "grpo"])
    from otbrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"none of the estimators .* --estimators") as err:
        resolve(cfg, estimators=["optimal_token_baseline", "rloo"])
    assert err.value.key == "algorithm.norm_adv_by_std_in_grpo"
