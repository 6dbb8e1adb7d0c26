"""A user's first hour with their own model: defaults for real models with the demo's settings
in presets, one-line errors for the usual first mistakes, the configuration printable, the
start and the end of a run said out loud, generations logged, checkpoints evaluated with their
own settings. Each test names what failed before."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from otbrl import cli
from otbrl.config import ConfigError, load_config
from otbrl.config.describe import key_comments
from otbrl.config.schema import all_keys
from otbrl.data import get_task, write_parquet_rows
from otbrl.models import load_model_and_tokenizer, resolve_model_dir
from otbrl.rollout import HFRollout, SamplingParams
from otbrl.run.plan import plan_run
from run_utils import refused, tiny_run_factory
from user_model import build_user_style_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(overrides(out_dir, *extra), root): a tiny model and arithmetic parquet files."""
    root = tmp_path_factory.mktemp("first_hour")
    return tiny_run_factory(root), root


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    return build_user_style_model(tmp_path_factory.mktemp("user"))


# -- defaults for real models, the demo's settings in presets -------------------------------------
def test_a_user_model_gets_the_fields_defaults_and_the_built_in_model_its_preset(tiny, tmp_path):
    """The schema's defaults were the demo's (lr 3e-4, 4-token responses, every checkpoint
    kept) and leaked into real runs."""
    overrides, root = tiny
    model = next(o for o in overrides(tmp_path) if o.startswith("model.path="))
    user = load_config(None, [model, f"data.train_files=[{root / 'train.parquet'}]"])
    assert user.actor.lr == 1e-6 and user.critic.lr == 1e-5
    assert user.data.max_response_length == 512 and user.data.max_prompt_length == 512
    assert user.trainer.keep_last_checkpoints == 2 and user.trainer.save_every == 50
    builtin = load_config(None, [])
    assert builtin.actor.lr == 3e-4 and builtin.data.max_response_length == 4
    assert builtin.trainer.save_every == 0 and builtin.data.task == "arithmetic"
    # the user's overrides still win over a preset
    assert load_config(None, ["actor.lr=1e-3"]).actor.lr == 1e-3
    tool = load_config(None, ["data.task=tool_arithmetic"])
    assert tool.rollout.multi_turn.tools == ["calculator"] and tool.actor.lr == 3e-4


def test_no_silent_fallback_to_a_built_in_task_for_a_user_model(tiny, tmp_path, capsys):
    overrides, _ = tiny
    model = next(o for o in overrides(tmp_path) if o.startswith("model.path="))
    refused(["train", model], capsys, "data.train_files", "data.task=arithmetic")
    # asked for by name, the task and its preset are used
    cfg = load_config(None, [model, "data.task=arithmetic"])
    assert cfg.data.max_response_length == 4
    assert len(plan_run(cfg).val_rows) == 500


def test_val_size_caps_a_validation_file_with_a_seeded_sample(tiny, tmp_path):
    overrides, _ = tiny
    val = write_parquet_rows(get_task("arithmetic").rows("val", 40, seed=3), tmp_path / "v.parquet")
    base = [*overrides(tmp_path), f"data.val_files=[{val}]"]
    every = plan_run(load_config(None, base)).val_rows
    capped = plan_run(load_config(None, [*base, "data.val_size=10"])).val_rows
    again = plan_run(load_config(None, [*base, "data.val_size=10"])).val_rows
    assert len(every) == 40 and len(capped) == 10 and capped == again
    positions = [every.index(row) for row in capped]
    assert positions == sorted(positions) and positions != list(range(10))  # sampled, in order


# -- prompts over the budget, the model's positions ---------------------------------------------
def test_prompts_over_the_budget_error_filter_or_truncate(tiny, tmp_path, capsys):
    """A prompt over data.max_prompt_length was a 21-line traceback after the model loaded."""
    overrides, _ = tiny
    rows = get_task("arithmetic").rows("train", 16, seed=0)
    for row in rows[:3]:
        row["prompt"][0]["content"] = "1+" * 20 + row["prompt"][0]["content"]
    train = write_parquet_rows(rows, tmp_path / "long.parquet")
    base = [
        *overrides(tmp_path / "run"),
        f"data.train_files=[{train}]",
        "data.max_prompt_length=20",
    ]
    refused(["train", *base], capsys, "3 of 16 train prompts", "data.overlong_prompts")
    plan = plan_run(load_config(None, [*base, "data.overlong_prompts=filter"]))
    assert len(plan.train_rows) == 13 and plan.longest_prompt <= 20
    assert any("dropped" in note for note in plan.notes)
    cut = load_config(None, [*base, "data.overlong_prompts=truncate_left"])
    plan = plan_run(cut)
    assert len(plan.train_rows) == 16 and plan.longest_prompt == 20
    from otbrl.data import encode_prompts
    from otbrl.run.plan import plan_tokenizer

    tok = plan_tokenizer(cut)
    enc = encode_prompts(rows[:1], tok, 20, overlong="truncate_left")
    full = encode_prompts(rows[:1], tok, 10**9)["input_ids"][0]
    assert enc["input_ids"].shape[1] == 20 and torch.equal(enc["input_ids"][0], full[-20:])


def test_the_hf_rollout_refuses_what_exceeds_the_models_positions(tiny, tmp_path, capsys):
    """vLLM refused it; the HF rollout ran past its positions without a word."""
    overrides, _ = tiny
    model_dir = next(o for o in overrides(tmp_path) if o.startswith("model.path="))[11:]
    model, tok = load_model_and_tokenizer(model_dir)  # 64 positions
    hf = HFRollout(model, tok)
    with pytest.raises(ValueError, match="max_model_len"):
        hf.generate([[5] * 40], SamplingParams(n=1, max_tokens=30, stop_token_ids=(2,)))
    # the line says what to set (it named the limit alone)
    refused(
        ["train", *overrides(tmp_path), "data.max_response_length=60"],
        capsys,
        "64 positions",
        "lower data.max_response_length to ",
        "data.overlong_prompts",
    )


# -- one line for the usual first mistakes --------------------------------------------------------
def test_a_model_directory_without_weights_is_one_line(user_dir, tiny, tmp_path, capsys):
    overrides, _ = tiny
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(user_dir / "config.json", bare)
    refused(["train", *overrides(tmp_path), f"model.path={bare}"], capsys, "no weights")


def test_a_tokenizer_without_a_chat_template(tmp_path, capsys):
    """A base model's tokenizer without a template was a 34-line traceback."""
    base_model = build_user_style_model(tmp_path / "base", chat_template=None)
    gsm = [
        {"prompt": [{"role": "user", "content": f"What is {i} plus 1?"}],
         "data_source": "openai/gsm8k", "reward_model": {"ground_truth": str(i + 1)}}
        for i in range(8)
    ]  # fmt: skip
    train = write_parquet_rows(gsm, tmp_path / "gsm.parquet")
    argv = ["train", f"model.path={base_model}", f"data.train_files=[{train}]",
            "data.train_batch_size=4", "data.max_response_length=8",
            f"trainer.output_dir={tmp_path / 'run'}"]  # fmt: skip
    refused(argv, capsys, "no chat template", "data.apply_chat_template=false")
    plan = plan_run(load_config(None, [*argv[1:], "data.apply_chat_template=false"]))
    assert plan.longest_prompt > 0
    from otbrl.data import render_prompts
    from otbrl.run.plan import plan_tokenizer

    tok = plan_tokenizer(load_config(None, [*argv[1:], "data.apply_chat_template=false"]))
    assert render_prompts(gsm[:1], tok) == ["What is 0 plus 1?"]


def test_hub_ids_resolve_in_the_local_cache_only(user_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snap = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(user_dir, snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("org/tiny") == snap
    with pytest.raises(ValueError, match=r"hf download org/other"):
        resolve_model_dir("org/other")


def test_a_missing_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch, capsys):
    """Issue 53: `otbrl eval model.path=runs/nothere` suggested `hf download runs/nothere`. A
    path under an existing directory, or one no hub id can be (a leading "." or "/", two
    slashes, characters hub names do not take), is a directory that does not exist."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "runs" / "lora").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for path in ("runs/nothere", "./nothere", "/no/such/model", "a/b/c", "my model/x"):
        with pytest.raises(ValueError) as caught:
            resolve_model_dir(path)
        message = str(caught.value)
        assert "hf download" not in message and "does not exist" in message, message
        assert repr(path) in message
    line = refused(["eval", "model.path=runs/nothere"], capsys, "'model.path'", "does not exist")
    assert "hf download" not in line and "runs holds: lora" in line  # a typo shows
    # a hub id still gets the download hint (no "Qwen" directory here)
    with pytest.raises(ValueError, match=r"hf download Qwen/Qwen2.5-0.5B"):
        resolve_model_dir("Qwen/Qwen2.5-0.5B")


# -- the configuration discoverable ---------------------------------------------------------------
def test_every_key_is_described():
    comments = key_comments()
    assert set(comments) == set(all_keys())
    assert [k for k, text in comments.items() if len(text) < 5] == []


def test_print_config_prints_every_key_and_loads_back(tmp_path, capsys):
    """--print-config was an unknown argument."""
    assert cli.main(["train", "--print-config", "data.task=tool_arithmetic", "actor.lr=2e-4"]) == 0
    text = capsys.readouterr().out
    assert "lr: 0.0002  # AdamW learning rate" in text and "[default: 1e-06]" in text
    loaded = yaml.safe_load(text)
    flat = set(_leaves(loaded))
    assert flat == set(all_keys())
    (tmp_path / "c.yaml").write_text(text)
    again = load_config(tmp_path / "c.yaml", [])
    want = load_config(None, ["data.task=tool_arithmetic", "actor.lr=2e-4"])
    assert again == want
    for command in ("sft", "eval"):
        assert cli.main([command, "--print-config"]) == 0
        assert "max_response_length: 4" in capsys.readouterr().out


def _leaves(node, prefix=""):
    for name, value in node.items():
        if isinstance(value, dict) and f"{prefix}{name}" not in all_keys():  # a group
            yield from _leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_help_lists_the_keys(capsys):
    with pytest.raises(SystemExit):
        cli._build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    assert "trainer.keep_last_checkpoints" in out and "--print-config" in out


def test_help_says_where_started_servers_listen(capsys):
    """Issue 53: --help (and --print-config, the generated reference) said otbrl starts its
    vLLM servers "on 127.0.0.1"; they listen on Unix sockets (rollout.server_process). Only
    the trainer's own address for weight fetches (weights_host) is a TCP host."""
    with pytest.raises(SystemExit):
        cli._build_parser().parse_args(["train", "--help"])
    lines = [x for x in capsys.readouterr().out.splitlines() if "rollout.server." in x]
    urls = next(x for x in lines if "rollout.server.urls " in x)
    assert "Unix socket" in urls, urls
    assert [x.split()[0] for x in lines if "127.0.0.1" in x] == ["rollout.server.weights_host"]


# -- a run says what it does; generations are logged; checkpoints evaluated as trained ---------
def test_a_run_says_it_starts_resumes_is_complete_and_logs_generations(tiny, tmp_path, capsys):
    overrides, _ = tiny
    run = tmp_path / "run"
    argv = ["train", *overrides(run), "trainer.log_generations=3"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert f"new run in {run}" in err
    assert "checkpoints every 2 steps, the newest 2 kept" in err and "MB each" in err
    lines = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0] * 3 + [2] * 3 + [4] * 3
    assert {"prompt", "response", "reward", "data_source"} <= set(lines[0])
    assert lines[0]["prompt"].endswith("<assistant>") and isinstance(lines[0]["reward"], float)
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "from step_4 (step 4)" in err and "already complete" in err
    # resuming at step 2 of a longer run drops the generations of the steps it redoes
    shutil.rmtree(run / "checkpoints" / "step_4")
    assert cli.main([*argv, "trainer.total_steps=2"]) == 0
    lines = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0] * 3 + [2] * 3


def test_the_checkpoint_line_counts_the_checkpoints_the_run_will_write():
    """A 2-step run with save_every=20 said "checkpoints every 20 steps, the newest 1 kept"
    (the default keeps 2: it read as a wrong default); save_every=1 said "every 1 steps"; a
    run of a multiple of save_every counted one checkpoint too many."""
    from otbrl.config.schema import TrainerConfig
    from otbrl.run.announce import startup_lines

    def line(**settings) -> str:
        t = TrainerConfig(**settings)
        kw = {"notes": [], "engines": [], "ckpt_root": Path("c"), "output_dir": Path("o")}
        return startup_lines(t, step=0, **kw)[0]

    assert line(total_steps=2, save_every=20).startswith(
        "one checkpoint, at the end of the run (step 2; trainer.save_every=20)"
    )
    assert line(total_steps=4, save_every=1).startswith("checkpoints every step, the newest 2")
    # steps 2 and 4: both kept, so at most 2 on disk (not 3) while the second is written
    assert "the newest 2 kept" in line(total_steps=4, save_every=2, keep_last_checkpoints=5)


def test_ctrl_c_says_what_was_kept(tiny, tmp_path, capsys, monkeypatch):
    """Ctrl-C with save_every=0 lost the run silently."""
    import otbrl.run.trainer as trainer_mod

    overrides, _ = tiny
    real = trainer_mod.Trainer.train_step

    def interrupt_at_3(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", interrupt_at_3)
    assert cli.main(["train", *overrides(tmp_path / "a")]) == 130
    err = capsys.readouterr().err
    assert "interrupted at step 3" in err and "step_2" in err and err.count("interrupted") == 1
    assert cli.main(["train", *overrides(tmp_path / "b"), "trainer.save_every=0"]) == 130
    err = capsys.readouterr().err
    assert "no checkpoint was written" in err and "starts over" in err


def test_sigterm_cleans_up_like_ctrl_c(tiny, tmp_path, capsys, monkeypatch):
    """``docker stop`` / a torchrun restart send SIGTERM: on main the process vanished at once,
    orphaning its reward workers (and vLLM servers, weight buckets); now the run stops as on
    Ctrl-C — workers stopped, what was kept said — and exits 128 + 15."""
    import multiprocessing
    import os
    import signal

    import otbrl.run.trainer as trainer_mod

    overrides, _ = tiny
    real = trainer_mod.Trainer.train_step

    def terminate_at_3(self):
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", terminate_at_3)
    assert cli.main(["train", *overrides(tmp_path / "a"), "reward.workers=1"]) == 143
    err = capsys.readouterr().err
    assert "interrupted at step 3" in err and "step_2" in err
    assert multiprocessing.active_children() == []  # the reward worker is gone
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was put back


def test_eval_of_a_run_directory_uses_its_checkpoint_and_settings(tiny, tmp_path, capsys):
    """`otbrl eval` decoded 4 tokens unless told otherwise and ignored the checkpoint's config."""
    overrides, _ = tiny
    run = tmp_path / "run"
    assert cli.main(["train", *overrides(run), "rollout.n=2", "trainer.total_steps=2"]) == 0
    capsys.readouterr()
    assert cli.main(["eval", f"model.path={run}"]) == 0
    captured = capsys.readouterr()
    assert "with the configuration it was trained with" in captured.err
    assert "on 8 prompts" in captured.out and str(run / "checkpoints" / "step_2") in captured.out
    # the user's overrides still apply on top of the checkpoint's settings
    assert cli.main(["eval", f"model.path={run}", "data.val_size=3"]) == 0
    assert "on 3 prompts" in capsys.readouterr().out


def test_a_misspelt_key_is_matched_group_first():
    with pytest.raises(ConfigError, match=r"did you mean 'trainer\.total_steps'"):
        load_config(None, ["trainr.total_steps=5"])
