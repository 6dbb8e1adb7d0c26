"""``otbrl variance``: per-estimator gradients against autograd, a 2-repeat smoke run, errors."""

import json
import math

import pytest
import torch

from otbrl import cli
from otbrl.algos import loss_math, loss_terms
from otbrl.algos.advantages import compute_advantage
from otbrl.data import get_task
from otbrl.engine.layout import Layout, forward_outputs
from otbrl.models import build_tiny_model, load_model_and_tokenizer
from otbrl.research.gradient_probe import EstimatorSpec, GradientProbe, parse_estimators
from otbrl.research.variance import format_table
from otbrl.rollout import SamplingParams
from run_utils import refused
from tiny_models import TWO_LAYERS

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {**TWO_LAYERS, "num_attention_heads": 2, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, **SMALL)


def _probe(path, method, agg):
    model, tokenizer = load_model_and_tokenizer(path)
    loss_kwargs = {"loss_agg_mode": agg, "horizon": 4}
    probe = GradientProbe(
        model,
        tokenizer,
        params=SamplingParams(temperature=1.0, max_tokens=4),
        options={"handle_zero_tail": True, "norm_adv_by_std_in_grpo": True},
        loss_fn=loss_terms.build_loss(**loss_kwargs),
        method=method,
    )
    rows = get_task("arithmetic").rows("train", 3, seed=0)
    return probe, rows, loss_kwargs


def test_probe_gradients_match_autograd_of_each_loss(tiny_model):
    probe, rows, loss_kwargs = _probe(tiny_model, "loop", "seq-mean-token-sum-norm")
    batch = probe.sample(rows, n=4, seed=3)
    # the trainer's batch, through the trainer's sampling step: the sampler's log-probs too
    assert batch["rollout_log_probs"].shape == batch["response_mask"].shape
    # a random reward makes every group informative whatever the tiny model answers
    gen = torch.Generator().manual_seed(0)
    batch["token_level_rewards"] = batch["token_level_rewards"] + torch.rand(
        batch["response_mask"].shape, generator=gen
    ) * (batch["response_mask"] > 0)
    specs = parse_estimators("grpo,rloo,otb")
    grads, extras = probe.gradients(batch, specs)
    assert grads.shape == (3, probe.num_params)
    probe.method = "batched"
    torch.testing.assert_close(probe.gradients(batch, specs)[0], grads, rtol=1e-4, atol=1e-7)
    for e, spec in enumerate(specs):
        # independent reference: a fresh forward, the configured loss, one plain backward
        probe.model.zero_grad(set_to_none=True)
        outputs = frozenset({"log_probs", "sum_pi_squared"})
        stats = forward_outputs(probe.model, batch, Layout(), outputs=outputs)
        old = stats["log_probs"].detach()
        adv, _ = compute_advantage(
            spec.name,
            token_level_rewards=batch["token_level_rewards"],
            response_mask=batch["response_mask"],
            index=batch["uid"],
            old_log_probs=old,
            sum_pi_squared=stats["sum_pi_squared"],
            **{**probe.options, **spec.options},
        )
        loss, _ = loss_math.ppo_policy_loss(
            stats["log_probs"], old, adv, batch["response_mask"], **loss_kwargs
        )
        loss.backward()
        want = torch.cat([p.grad.reshape(-1) for p in probe.params])
        torch.testing.assert_close(grads[e], want, rtol=1e-4, atol=1e-7)
    assert 0 <= extras["tail_tokens"] <= extras["tokens"]
    assert set(extras["power"]) == {"grpo", "rloo", "otb"}


def test_probe_samples_through_the_agent_loop(tmp_path):
    """Tool runs: the probe's batches come from the agent loop (holes, the reward on the last
    model token after them), and its TIR-OTB gradient is the autograd one on such a batch."""
    from otbrl.rollout import make_agent
    from otbrl.rollout.config import MultiTurnConfig
    from otbrl.tools import resolve_tools
    from test_agent_loop import ScriptedEngine, tool_then_answer

    path = build_tiny_model(tmp_path / "tool", task="tool_arithmetic", seed=0, **SMALL)
    model, tokenizer = load_model_and_tokenizer(path)
    tools = resolve_tools(["calculator"])
    agent = make_agent(
        ScriptedEngine(tool_then_answer), tokenizer, tools,
        MultiTurnConfig(max_turns=3), eos_token_ids=[tokenizer.eos_token_id],
    )  # fmt: skip
    probe = GradientProbe(
        model, tokenizer, params=SamplingParams(temperature=1.0, max_tokens=32),
        options={"handle_zero_tail": True, "norm_adv_by_std_in_grpo": True},
        loss_fn=loss_terms.build_loss(loss_agg_mode="token-mean"), sampler=agent,
    )  # fmt: skip
    rows = get_task("tool_arithmetic").rows("train", 2, seed=0)
    batch = probe.sample(rows, n=2, seed=0)
    # sample 0 answers "123" at once (wrong); sample 1 calls and copies the product (right)
    assert batch["num_turns"].tolist() == [1, 2, 1, 2]
    mask = batch["response_mask"]
    attention = batch["attention_mask"][:, batch["prompts"].shape[1] :]
    assert ((attention > 0) & (mask == 0)).any(dim=1).tolist() == [False, True, False, True]
    rewards = batch["token_level_rewards"]
    assert rewards.sum(dim=1).tolist() == [0.0, 1.0, 0.0, 1.0]
    last = torch.where(mask > 0, torch.arange(1, mask.shape[1] + 1), 0).amax(1) - 1
    assert torch.equal(rewards[torch.arange(4), last], rewards.sum(dim=1))
    (spec,) = parse_estimators("tir_optimal_token_baseline")
    grads, _ = probe.gradients(batch, [spec])
    probe.model.zero_grad(set_to_none=True)
    stats = forward_outputs(
        probe.model, batch, Layout(), outputs=frozenset({"log_probs", "sum_pi_squared"})
    )
    old = stats["log_probs"].detach()
    adv, _ = compute_advantage(
        spec.name, token_level_rewards=rewards, response_mask=mask, index=batch["uid"],
        old_log_probs=old, sum_pi_squared=stats["sum_pi_squared"], **probe.options,
    )  # fmt: skip
    assert (adv[mask == 0] == 0).all() and (adv != 0).any()
    loss, _ = loss_math.ppo_policy_loss(
        stats["log_probs"], old, adv, mask, loss_agg_mode="token-mean"
    )
    loss.backward()
    want = torch.cat([p.grad.reshape(-1) for p in probe.params])
    torch.testing.assert_close(grads[0], want, rtol=1e-4, atol=1e-7)


def test_parse_estimators_aliases_and_options():
    specs = parse_estimators("otb_notail,drgrpo,optimal_token_baseline:energy=uniform:x=1.5")
    assert specs[0] == EstimatorSpec(
        "otb_notail", "optimal_token_baseline", {"handle_zero_tail": False}
    )
    assert specs[1].name == "grpo" and specs[1].options == {"norm_adv_by_std_in_grpo": False}
    assert specs[2].options == {"energy": "uniform", "x": 1.5}
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        parse_estimators("grpo,gpro")
    with pytest.raises(ValueError, match="key=value"):
        parse_estimators("otb:energy")
    with pytest.raises(ValueError, match="distinct"):
        parse_estimators("otb,otb")


def test_two_repeat_smoke_run(tiny_model, tmp_path, capsys):
    out = tmp_path / "v.json"
    # the random-init model never answers right: a length reward gives the groups signal
    reward = tmp_path / "reward.py"
    reward.write_text("def length(source, text, truth, extra):\n    return float(len(text))\n")
    argv = [
        "variance",
        f"model.path={tiny_model}",
        "data.task=arithmetic",
        f"reward.function={reward}:length",
        "data.max_response_length=4",
        "--estimators=grpo,rloo,otb",
        "--n=3",
        "--repeats=2",
        "--prompts=2",
        "--reference-samples=4",
        "--bootstrap=50",
        f"--out={out}",
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "otb" in printed and "wrote" in printed
    # issue 53: K = 2 has no interval (a leave-one-out resample holds one repeat): it printed
    # "[nan, nan]" and no word why
    assert "nan" not in printed and "— (no interval: needs --repeats ≥ 3)" in printed
    result = json.loads(out.read_text())
    res = result["results"]["3"]
    for label in ("grpo", "rloo", "otb"):
        row = res["estimators"][label]
        for key in ("variance", "signal_scale", "variance_per_signal"):
            assert math.isfinite(row[key])
        assert row["variance"] >= 0
    assert set(res["ratios"]) == {"rloo/grpo", "otb/grpo"}
    for ratio in res["ratios"].values():
        assert ratio["value"] > 0 and len(ratio["ci95"]) == 2
    assert 0 <= res["zero_tail_token_share"] <= 1
    assert set(res["proxy_calibration"]) == {"grpo", "rloo", "otb"}
    assert "pearson_raw" in result["proxy_correlation"]
    assert out.with_suffix(".png").stat().st_size > 0
    # markdown beside it: one row per estimator, the ratios as printed in the JSON
    markdown = out.with_suffix(".md").read_text()
    otb_ratio = res["ratios"]["otb/grpo"]
    assert f"| otb | {res['estimators']['otb']['variance']:.4g} |" in markdown
    assert otb_ratio["ci95"] == [None, None]  # K = 2: the interval is undefined (JSON null)
    assert f"{otb_ratio['value']:.3f} — (no interval: needs --repeats ≥ 3) |" in markdown
    assert "| grpo |" in markdown and "(base)" in markdown
    # without a bootstrap there is no interval either, and the table says why
    for ratios in (res["ratios"], res["ratios_per_signal"]):
        for ratio in ratios.values():
            del ratio["ci95"]
    table = format_table(result)
    assert "nan" not in table and table.count("— (no interval: --bootstrap=0)") == 4


@pytest.mark.parametrize(
    ("flags", "word"),
    [
        (["--estimators=grpo,gpro"], "gpro"),
        (["--base=otb", "--estimators=grpo,rloo"], "base"),
        (["--repeats=1"], "repeats"),
        (["--n=4,x"], "invalid literal"),
    ],
)
def test_bad_flags_exit_2_before_loading(flags, word, capsys, no_model_loading):
    refused(["variance", *flags], capsys, word)


def test_a_policy_with_nothing_to_measure_is_one_line(tiny_model, tmp_path, capsys):
    """Every group scored alike (a user's model that never answers right) ended in a Python
    traceback; more --prompts than the data has was found after the model loaded."""
    reward = tmp_path / "reward.py"
    reward.write_text("def zero(source, text, truth, extra):\n    return 0.0\n")
    argv = [
        "variance",
        f"model.path={tiny_model}",
        "data.task=arithmetic",
        f"reward.function={reward}:zero",
        "data.max_response_length=4",
        "--n=3",
        "--repeats=2",
        "--prompts=2",
        "--reference-samples=4",
        f"--out={tmp_path / 'v.json'}",
    ]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("otbrl variance: error: reference: the RLOO reference gradient is zero")
    assert "\n" not in err and "Traceback" not in err
    refused([*argv[:-2], "--prompts=100000"], capsys, "--prompts 100000", "rows")
