"""otbrl.cli: user errors exit 2 with one line naming the key, before any model loads."""

import subprocess
import sys

import pytest

from otbrl import cli
from otbrl.models import build_tiny_model
from run_utils import refused


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["train", "actor.lrr=1e-4"], "actor.lrr"),
        (["train", "actor.lr=fast"], "actor.lr"),
        (["train", "actor.loss_agg_mode=mean"], "actor.loss_agg_mode"),
        (
            ["train", "data.train_batch_size=8", "actor.ppo_mini_batch_size=3"],
            "actor.ppo_mini_batch_size",
        ),
        (["train", "algorithm.adv_estimator=gae", "critic.enable=false"], "critic.enable"),
        (["train", "actor.kl_loss_type=k5"], "actor.kl_loss_type"),
        (["train", "critic.cliprange_value=0"], "critic.cliprange_value"),
        (["train", "actor.calculate_sum_pi_squared=false"], "actor.calculate_sum_pi_squared"),
        (["train", "algorithm.adv_estimator=gpro"], "algorithm.adv_estimator"),
        (["train", "data.train_files=/no/such.parquet"], "data.train_files"),
        (["train", "model.path=/no/such/model"], "model.path"),
        (["train", "data.task=chess"], "data.task"),
        (["train", "data.task=digit_sum"], "data.max_response_length=9"),
        (["demo", "trainer.total_step=3"], "trainer.total_step"),
        (["eval", "rollout.top_p=0"], "rollout.top_p"),
        (["sft", "sft.target_accuracy=2"], "sft.target_accuracy"),
    ],
)
def test_config_errors_exit_2_with_one_line(argv, key, capsys, no_model_loading):
    refused(argv, capsys, key)


def test_missing_config_file_and_bad_override(tmp_path, capsys, no_model_loading):
    assert cli.main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err
    assert cli.main(["train", "actor.lr"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_sum_pi_squared_false_is_fine_when_nobody_needs_it(capsys, monkeypatch, tmp_path):
    import otbrl.run.trainer as trainer_mod

    monkeypatch.chdir(tmp_path)  # the run directory (runs/default) is claimed before the trainer

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(trainer_mod.Trainer, "__init__", stop)
    with pytest.raises(Stop):  # validation passed, the trainer was about to be built
        cli.main(["train", "algorithm.adv_estimator=grpo", "actor.calculate_sum_pi_squared=false"])


def test_usage_errors():
    assert cli.main([]) == 2
    assert cli.main(["fly"]) == 2
    assert cli.main(["--help"]) == 0


def test_subprocess_exit_code_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "otbrl", "train", "actor.lrr=1e-4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "did you mean 'actor.lr'" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_plot_and_export_of_missing_paths_are_one_line_errors(tmp_path, capsys):

    err = refused(["plot", str(tmp_path / "no_run")], capsys, "run_dir")
    assert err.startswith("otbrl: error:")
    err = refused(["export", str(tmp_path / "no_ckpt"), str(tmp_path / "out")], capsys)
    assert err.startswith("otbrl: error:")


@pytest.mark.parametrize("backend, module", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_missing_logger_package_is_a_config_error_before_loading(backend, module, capsys):
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    refused(["train", f"trainer.logger=[console,{backend}]"], capsys, "'trainer.logger'", module)


MARKED_REWARD = """
import pathlib
pathlib.Path(__file__).with_suffix(".imported").touch()

def score(data_source, solution_str, ground_truth, extra_info):
    return float(len(solution_str) % 2)
"""


def test_eval_without_validation_prompts_is_refused(tiny_dir, capsys, no_model_loading):
    """``otbrl eval`` of a model with no validation data printed ``val accuracy: 0.0000 on 0
    prompts`` and exited 0; it is one line naming the data key, before any model loads."""
    refused(["eval", f"model.path={tiny_dir}"], capsys, "'data.val_files'", "nothing to evaluate")


def test_eval_treats_a_checkpoints_config_as_data(tiny_run, tmp_path, capsys, monkeypatch):
    """``otbrl eval RUN_DIR`` of someone else's run: the user code its config names is not
    imported unless given again (said on stderr), its ``${...}`` text is not resolved (here it
    would read an environment variable into a file path), and the hosts and engines eval does
    not use are not taken (its vLLM server urls are never contacted)."""
    import yaml

    reward = tmp_path / "marked.py"
    reward.write_text(MARKED_REWARD)
    run = tmp_path / "run"
    assert cli.main(["train", *tiny_run(run, f"reward.function={reward}:score")]) == 0
    marker = reward.with_suffix(".imported")
    assert marker.exists()  # training imported it
    marker.unlink()
    capsys.readouterr()
    assert cli.main(["eval", f"model.path={run}"]) == 0  # arithmetic rows: a built-in reward
    err = capsys.readouterr().err
    assert not marker.exists() and f"reward.function={reward}:score" in err
    assert cli.main(["eval", f"model.path={run}", f"reward.function={reward}:score"]) == 0
    assert "not taken from the checkpoint" not in capsys.readouterr().err  # given again
    # a config edited to read a secret and to point at servers
    monkeypatch.setenv("OTBRL_TEST_SECRET", "s3cret")
    saved = next((run / "checkpoints").glob("step_*")) / "config.yaml"
    cfg = yaml.safe_load(saved.read_text())
    cfg["rollout"].update(name="vllm", mode="server")  # eval samples with the HF engine
    cfg["rollout"]["server"]["urls"] = ["http://127.0.0.1:9/${oc.env:OTBRL_TEST_SECRET}"]
    saved.write_text(yaml.safe_dump(cfg))
    assert cli.main(["eval", f"model.path={saved.parent}"]) == 0  # the url: never contacted
    cfg["data"]["val_files"] = ["/nowhere/${oc.env:OTBRL_TEST_SECRET}.parquet"]
    saved.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert cli.main(["eval", f"model.path={saved.parent}"]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "'data.val_files' file not found" in line and "Traceback" not in err
    assert "${oc.env:OTBRL_TEST_SECRET}" in line and "s3cret" not in err


def test_serve_refuses_what_it_cannot_serve_in_one_line(tmp_path, capsys):
    """``otbrl serve`` of a directory that holds no model, or of a run without a checkpoint:
    one line naming the argument, exit 2, before vLLM starts (a server that trains with
    ``otbrl train`` runs for real in tests/test_cli_zoo.py, started by the rollout guide's
    line)."""
    refused(["serve", str(tmp_path / "nowhere")], capsys, "'model'")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    refused(["serve", str(tmp_path / "run")], capsys, "'model'", "checkpoint")
    refused(["serve", str(tmp_path), "--port", "70000"], capsys, "'--port'")
    # a head size vLLM's CPU attention has no kernel for: it served, then failed at the first
    # request (the trainer refused its model.path before any of that)
    small = build_tiny_model(tmp_path / "m16", hidden_size=64, num_attention_heads=4)
    refused(["serve", str(small)], capsys, "'model'", "head_dim 16 (config.json's head_dim)")


def test_serve_says_it_is_starting_before_vllm_answers(tmp_path, capsys, monkeypatch):
    """``otbrl serve`` printed nothing for the half minute vLLM takes to start on a CPU."""
    import otbrl.rollout.server_process as server_process

    said = []

    class Stand_in:  # the vLLM server process
        def __init__(self, url, command, env, log, token):
            self.log, self.token = log, token

        def start(self):
            pass

        def wait_ready(self, timeout_s, model_dir):
            said.append(capsys.readouterr().err)

        def alive(self):
            return False  # it stops at once: serve returns

        def log_tail(self):
            return "stopped"

        def close(self):
            pass

    monkeypatch.setattr(server_process, "Server", Stand_in)
    model = build_tiny_model(tmp_path / "m", hidden_size=64, num_attention_heads=2)
    assert cli.main(["serve", str(model), "--log", str(tmp_path / "log")]) == 1
    assert said and f"otbrl: starting vLLM for {model}" in said[0], said


def test_a_renamed_key_is_one_warning_line(capsys):
    """The renamed key's FutureWarning came as Python prints warnings: a file path, a line
    number and the source line of the CLI that loaded the configuration."""
    assert cli.main(["train", "actor.engine=fsdp", "--print-config"]) == 0
    err = capsys.readouterr().err
    assert (
        err == "otbrl: warning: 'actor.engine' is now 'actor.strategy' (override "
        "'actor.engine=fsdp')\n"
    ), err
