"""``otbrl compare``: curve extraction, the summary against hand-computed values, a tiny run."""

import json
import math

import pytest

from otbrl.research.compare import (
    arm_estimator_overrides,
    arm_label,
    arm_steps,
    check_base,
    check_settings,
    parse_arms,
    run_compare,
)
from otbrl.research.compare_report import (
    late_mean,
    markdown_table,
    run_curves,
    summarize,
    tokens_ratio,
    tokens_to_target,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_parse_arms_and_steps():
    assert parse_arms("grpo:4, optimal_token_baseline:16") == [
        ("grpo", 4),
        ("optimal_token_baseline", 16),
    ]
    assert parse_arms("drgrpo:4,otb_notail:16") == [("drgrpo", 4), ("otb_notail", 16)]
    for bad in ("grpo", "grpo:x", "grpo:1", ":4", "gpro:4", "grpo:4,grpo:4"):
        with pytest.raises(ValueError, match="arms"):
            parse_arms(bad)
    # equal budget of sampled responses: n = 16 takes a quarter of the steps of n = 4
    assert arm_steps(6400, 16, 4) == 100 and arm_steps(6400, 16, 16) == 25
    assert arm_label("optimal_token_baseline", 4) == "OTB N=4"
    assert arm_label("drgrpo", 16) == "Dr. GRPO N=16"


def test_alias_arms_set_the_estimator_options():
    from otbrl.config import load_config

    overrides = arm_estimator_overrides("drgrpo")
    assert overrides == [
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=false",
    ]
    cfg = load_config(None, arm_estimator_overrides("otb_loo"))
    assert cfg.algorithm.adv_estimator == "optimal_token_baseline"
    assert cfg.algorithm.otb.leave_one_out is True
    assert arm_estimator_overrides("rloo") == ["algorithm.adv_estimator=rloo"]


def _write_run(path, lengths, grad_norms, val):
    path.mkdir(parents=True)
    lines = [{"step": 0, "val/accuracy": val[0]}]
    for step, (length, g) in enumerate(zip(lengths, grad_norms), start=1):
        record = {"step": step, "train/response_length_mean": length, "policy/grad_norm": g}
        if step in val:
            record["val/accuracy"] = val[step]
        lines.append(record)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_run_curves_counts_generated_tokens(tmp_path):
    _write_run(tmp_path / "r", [3.0, 4.0, 5.0], [1.0, 9.0, 2.0], {0: 0.1, 2: 0.4, 3: 0.6})
    curve = run_curves(tmp_path / "r", responses_per_step=10)
    # tokens after step s = 10 × Σ_{j ≤ s} length_j
    assert curve["tokens"] == [0.0, 70.0, 120.0]
    assert curve["accuracy"] == [0.1, 0.4, 0.6]
    assert curve["grad_norm"] == [1.0, 9.0, 2.0]
    assert curve["final_accuracy"] == 0.6
    # last quarter of the tokens: validations at ≥ 0.75 × 120 = 90 tokens -> only the last
    assert curve["late_accuracy"] == 0.6
    assert late_mean([0, 100, 200, 300, 400], [0.1, 0.2, 0.3, 0.5, 0.7]) == pytest.approx(0.6)
    assert tokens_to_target(curve, 0.5) == 120.0
    assert tokens_to_target(curve, 0.4) == 70.0
    assert tokens_to_target(curve, 0.9) == math.inf
    # for good: a run that touches the target and falls back has not stayed there yet
    bumpy = {"tokens": [0, 10, 20, 30, 40], "accuracy": [0.1, 0.9, 0.7, 0.9, 0.95]}
    assert tokens_to_target(bumpy, 0.85) == 10 and tokens_to_target(bumpy, 0.85, stay=True) == 30
    fell = {"tokens": [0, 10, 20], "accuracy": [0.1, 0.9, 0.7]}
    assert tokens_to_target(fell, 0.85, stay=True) == math.inf
    assert tokens_to_target(curve, 0.5, stay=True) == 120.0


def test_summary_matches_hand_computation():
    a = {"tokens": [0, 100, 200], "accuracy": [0.1, 0.6, 0.7], "grad_norm": [1.0, 3.0, 2.0]}
    b = {"tokens": [0, 100, 200], "accuracy": [0.1, 0.2, 0.5], "grad_norm": [4.0, 2.0, 6.0]}
    c = {"tokens": [0, 100, 200], "accuracy": [0.1, 0.2, 0.3], "grad_norm": [1.0, 1.0, 1.0]}
    for curve in (a, b, c):
        curve["final_accuracy"] = curve["accuracy"][-1]
    out = summarize({"X": [a, b], "Y": [c]}, target=0.5)
    x = out["X"]
    assert x["reached_target"] == 2 and x["seeds"] == 2
    assert x["tokens_to_target_mean"] == pytest.approx(150.0)
    assert x["tokens_to_target_std"] == pytest.approx(math.sqrt(((100 - 150) ** 2 + 50**2) / 1))
    assert x["final_accuracy_mean"] == pytest.approx(0.6)
    assert x["final_accuracy_std"] == pytest.approx(math.sqrt(2 * 0.1**2))
    assert x["late_accuracy_mean"] == pytest.approx(0.6)  # no late_accuracy given: the final
    assert x["grad_norm_max"] == pytest.approx((3.0 + 6.0) / 2)
    assert x["grad_norm_median"] == pytest.approx((2.0 + 4.0) / 2)
    assert out["Y"]["reached_target"] == 0 and out["Y"]["tokens_to_target_mean"] == math.inf
    # a stays at 0.6, 0.7 from 100 tokens on; b only reaches 0.5 at its last validation
    assert x["stayed_at_target"] == 2 and x["tokens_to_stay_mean"] == pytest.approx(150.0)
    table = markdown_table(out, 0.5)
    assert "| X | 150 ± 71 (2/2) | 150 ± 71 (2/2) |" in table and "| Y | never (0/1) |" in table


def test_tokens_ratio_against_the_bootstrap_worked_by_hand():
    def curve(reach_at):  # validations every 100 tokens; accuracy 0.6 from reach_at on
        tokens = [0, 100, 200, 300]
        return {"tokens": tokens, "accuracy": [0.6 if t >= reach_at else 0.1 for t in tokens]}

    curves = {
        "X": [curve(100), curve(200)],
        "B": [curve(300)] * 3,
        "Y": [curve(100), curve(1000)],  # the second seed never reaches 0.5
    }
    out = tokens_ratio(curves, "B", 0.5, resamples=4000)
    assert out["B"] == {"value": 1.0, "ci95": [1.0, 1.0], "censored": 0, "seeds": 3}
    # X's resampled means are 100, 150 or 200 (1/4, 1/2, 1/4), B's always 300
    assert out["X"]["value"] == pytest.approx(0.5)
    assert out["X"]["ci95"] == pytest.approx([1 / 3, 2 / 3]) and out["X"]["censored"] == 0
    # the unreached seed counts with all its tokens (300): a bound, and said so
    assert out["Y"]["value"] == pytest.approx(200 / 300) and out["Y"]["censored"] == 1
    stay = tokens_ratio(curves, "B", 0.5, resamples=4000, stay=True)
    assert stay["X"]["value"] == pytest.approx(0.5)  # these curves never fall back
    table = markdown_table(summarize(_with_norms(curves), 0.5), 0.5, out, "B", stay)
    assert table.count("÷ B's [95 % CI]") == 2 and "| 0.50 [0.33, 0.67] |" in table
    assert "(1 of 2 seeds unreached, counted at their budget)" in table
    with pytest.raises(ValueError, match="base: expected one of the arms"):
        tokens_ratio(curves, "Z", 0.5)


def test_unreached_seeds_are_counted_per_arm_and_a_bound_has_no_interval():
    """Issue 53: arms of 2 seeds each said "(4 unreached seeds ...)" (the arm's and the base's
    summed), and an arm that never reached the target got a bootstrap interval of its bound."""

    def curve(reach_at):
        tokens = [0, 100, 200, 300]
        return {"tokens": tokens, "accuracy": [0.6 if t >= reach_at else 0.1 for t in tokens]}

    curves = {
        "X": [curve(100), curve(200)],
        "B": [curve(300), curve(1000)],  # one of two seeds reached
        "N": [curve(1000), curve(1000)],  # never
    }
    out = tokens_ratio(curves, "B", 0.5, resamples=1000)
    assert [out[k]["censored"] for k in "XBN"] == [0, 1, 2]
    assert out["N"]["ci95"] is None and out["N"]["value"] == pytest.approx(1.0)
    table = markdown_table(summarize(_with_norms(curves), 0.5), 0.5, out, "B")
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines()[2:]}
    assert "unreached" not in rows["X"]  # B's unreached seed is B's row's to say
    assert "(1 of 2 seeds unreached, counted at their budget)" in rows["B"]
    assert "| ≥ 1.00 (no seed reached it: a bound, no CI) |" in rows["N"]
    # a base that never reached it: the others' ratios are bounds the other way
    never = tokens_ratio(curves, "N", 0.5, resamples=1000)
    assert never["X"]["ci95"] is None and never["N"]["ci95"] is None
    table = markdown_table(summarize(_with_norms(curves), 0.5), 0.5, never, "N")
    assert "| ≤ 0.50 (N never reached it: a bound, no CI) |" in table
    assert table.count("— (no seed reached it: no ratio)") == 1


def _with_norms(curves):
    return {
        label: [{**c, "grad_norm": [1.0], "final_accuracy": c["accuracy"][-1]} for c in runs]
        for label, runs in curves.items()
    }


def test_base_arm_must_be_one_of_the_arms(capsys):
    from otbrl.research.compare import main

    arms = parse_arms("grpo:4,grpo:32")
    assert check_base("grpo:32", arms) == "GRPO N=32" and check_base(None, arms) is None
    for bad in ("grpo:16", "grpo", "grpo:4,grpo:32"):
        with pytest.raises(ValueError, match=r"--base: expected one of the arms \(grpo:4,grpo:32"):
            check_base(bad, arms)
    assert main(["--arms", "grpo:4,grpo:32", "--base", "otb:4"]) == 2
    assert "--base" in capsys.readouterr().err


def _tiny_setup(tmp_path, reward_body="return float(len(text))"):
    from otbrl.models import build_tiny_model
    from tiny_models import TWO_LAYERS

    size = {**TWO_LAYERS, "num_attention_heads": 2, "num_key_value_heads": 2}
    model = build_tiny_model(tmp_path / "m", seed=0, **size)
    reward = tmp_path / "reward.py"
    reward.write_text(f"def length(source, text, truth, extra):\n    {reward_body}\n")
    return [
        f"model.path={model}",
        "data.task=arithmetic",  # a model directory of its own: the task is named
        f"reward.function={reward}:length",
        "data.max_response_length=4",
        "data.val_size=8",
        "actor.micro_batch_size=2",
    ]


def _tiny_kwargs(tmp_path, **extra):
    return {
        "arms": "grpo:2,optimal_token_baseline:2",
        "seeds": 1,
        "budget_responses": 8,
        "prompts": 2,
        "target": 0.5,
        "out_dir": str(tmp_path / "cmp"),
        "echo": lambda _: None,
        **extra,
    }


def test_tiny_comparison_run(tmp_path):
    overrides, kwargs = _tiny_setup(tmp_path), _tiny_kwargs(tmp_path, base="grpo:2")
    out = run_compare(None, overrides, **kwargs)
    assert set(out["summary"]) == {"GRPO N=2", "OTB N=2"}
    assert out["base"] == "GRPO N=2" and set(out["tokens_ratio"]) == set(out["summary"])
    for curves in out["curves"].values():
        assert len(curves) == 1 and len(curves[0]["grad_norm"]) == 2  # 8 / (2 × 2) steps
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0
    assert "GRPO N=2" in (tmp_path / "cmp" / "compare.md").read_text()
    # finished runs are read back, not retrained: same curves, no new metrics lines
    metrics = tmp_path / "cmp" / "grpo-n2" / "seed0" / "metrics.jsonl"
    before = metrics.read_text()
    again = run_compare(None, overrides, **kwargs)
    assert again["curves"] == out["curves"] and metrics.read_text() == before
    # ... but not when the settings changed: that would mix settings in one table
    with pytest.raises(ValueError, match=r"seed0 finished with actor\.lr=.*another --out-dir"):
        run_compare(None, [*overrides, "actor.lr=1e-3"], **kwargs)


def test_parallel_jobs_train_in_subprocesses_like_in_process(tmp_path):
    """--jobs 2: each run is its own `otbrl train` process; the curves equal in-process ones."""
    overrides = _tiny_setup(tmp_path)
    serial = run_compare(None, overrides, **_tiny_kwargs(tmp_path / "a"))
    parallel = run_compare(None, overrides, **_tiny_kwargs(tmp_path / "b", jobs=2))
    assert parallel["curves"] == serial["curves"]
    assert (tmp_path / "b" / "cmp" / "grpo-n2" / "seed0" / "train.log").is_file()


def test_failed_runs_are_named_after_the_others_finish(tmp_path):
    overrides = _tiny_setup(tmp_path, reward_body="raise RuntimeError('reward broke')")
    with pytest.raises(RuntimeError, match=r"(?s)GRPO N=2 seed 0: exit code 1.*OTB N=2 seed 0"):
        run_compare(None, overrides, **_tiny_kwargs(tmp_path, jobs=2))


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"seeds": 0}, "--seeds"),
        ({"jobs": 0}, "--jobs"),
        ({"prompts": 3, "updates_per_step": 2}, "divisible by --updates-per-step"),
    ],
)
def test_bad_settings_name_the_option(kwargs, flag):
    settings = {"seeds": 1, "budget_responses": 8, "prompts": 2, "updates_per_step": 1, "jobs": 1}
    with pytest.raises(ValueError, match=flag):
        check_settings(**{**settings, **kwargs})


def test_cli_rejects_bad_settings_before_loading_a_model(capsys):
    from otbrl.research.compare import main

    assert main(["--prompts", "5", "--updates-per-step", "2"]) == 2
    assert "--updates-per-step" in capsys.readouterr().err


def test_overrides_may_sit_between_the_options(capsys):
    """``otbrl compare data.task=X --seeds 3 actor.lr=Y``: argparse alone takes one run of
    positionals; the command reads them all (the check after parsing answers)."""
    from otbrl.research.compare import build_parser, main

    args = build_parser().parse_intermixed_args(
        ["data.task=chain_sum", "--seeds", "2", "actor.lr=1e-4", "--jobs", "2", "x.y=1"]
    )
    assert args.overrides == ["data.task=chain_sum", "actor.lr=1e-4", "x.y=1"]
    assert args.seeds == 2 and args.jobs == 2
    assert main(["data.task=arithmetic", "--seeds", "0", "actor.lr=1e-3"]) == 2
    assert "--seeds: expected an integer >= 1" in capsys.readouterr().err


def test_an_interrupted_comparison_stops_its_runs(tmp_path):
    """SIGTERM (or Ctrl-C) to ``otbrl compare --jobs 2`` reaches its training runs: they stop
    (at their newest checkpoint, to resume on the next compare) and compare exits, instead of
    waiting for runs nobody will read."""
    import signal
    import subprocess
    import sys
    import time

    overrides = _tiny_setup(tmp_path)
    out = tmp_path / "cmp"
    command = [
        sys.executable, "-m", "otbrl", "compare", *overrides, "--arms", "grpo:2,rloo:2",
        "--seeds", "1", "--budget", "400000", "--prompts", "2", "--updates-per-step", "1",
        "--jobs", "2", "--out-dir", str(out),
    ]  # fmt: skip
    compare = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    logs = [out / arm / "seed0" / "metrics.jsonl" for arm in ("grpo-n2", "rloo-n2")]
    deadline = time.monotonic() + 120
    while not all(p.is_file() and p.stat().st_size for p in logs):
        assert compare.poll() is None and time.monotonic() < deadline, compare.stderr.read()
        time.sleep(0.2)
    compare.send_signal(signal.SIGTERM)
    assert compare.wait(timeout=60) == 128 + signal.SIGTERM
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout
    assert left == ""  # no training run outlives the comparison
    for arm in ("grpo-n2", "rloo-n2"):
        assert "otbrl: interrupted at step" in (out / arm / "seed0" / "train.log").read_text()
