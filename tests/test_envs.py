"""Environments: the protocol's checks, calls under a timeout (plain and ``async``), the agent
loop over a user's Gymnasium-style environment on a scripted engine (the stream is the sampled
ids plus the observations' ids, step rewards on their turns, failures that fail their sample
alone), the sampling step's rewards, and the built-in guess environment and task."""

import asyncio
import json
import math
import time

import pytest
import torch

from otbrl.data import get_task
from otbrl.envs import (
    EnvError,
    EnvRunner,
    check_reset,
    check_step,
    observation_messages,
    reset_seed,
    resolve_env,
)
from otbrl.envs.builtin import BUILTIN_ENVS, GuessEnv
from otbrl.models import build_tokenizer
from otbrl.rollout import Completion, SamplingParams, make_agent
from otbrl.rollout.config import MultiTurnConfig
from otbrl.run.sampling import Scoring, sample_batch

TASK = get_task("guess")
TOK = build_tokenizer(TASK.alphabet)
EOS = TOK.eos_token_id

# A user's environment file: Gymnasium's shape, nothing imported from otbrl. The row's
# extra_info.mode picks how it behaves, so one batch holds every kind of failure.
ENV_FILE = """
import asyncio, time

class Guess:
    def __init__(self, secret, mode):
        self.secret, self.mode, self.steps = secret, mode, 0

    def reset(self, seed=None, options=None):
        if self.mode == "reset_raises":
            raise KeyError("no such level")
        if self.mode == "reset_hangs":
            time.sleep(30)
        if self.mode == "reset_garbage":
            return "just an observation"
        return None, {"seed": seed}

    def step(self, action):
        self.steps += 1
        if self.mode == "raises" and self.steps == 2:
            raise RuntimeError("the simulator crashed")
        if self.mode == "hangs":
            time.sleep(30)
        if self.mode == "garbage":
            return "+", float("nan"), False, False, {}
        if self.mode == "three":
            return "+", 0.0, False
        guess = int(action) if action.strip().isdigit() else -1
        if guess == self.secret:
            return None, 1.0, True, False, {}
        return ("+" if self.secret > guess else "-"), -0.125, False, False, {}

class AsyncGuess(Guess):
    async def step(self, action):
        await asyncio.sleep(0)
        if self.mode == "async_hangs":
            await asyncio.sleep(30)
        return Guess.step(self, action)

def make(row):
    mode = row["extra_info"].get("mode", "ok")
    if mode == "make_raises":
        raise ValueError("bad row")
    cls = AsyncGuess if mode.startswith("async") else Guess
    return cls(int(row["reward_model"]["ground_truth"]), mode)
"""


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class Bisect:
    """A RolloutBackend that bisects 1..15 from the observations in its context: every turn is
    the midpoint of the interval left, with log-prob -(1 + position) / 100 per token."""

    name = "bisect"

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, *, max_tokens=None):
        self.calls.append((len(prompts), params))
        budgets = [params.max_tokens] * len(prompts) if max_tokens is None else list(max_tokens)
        out = []
        for prompt, budget in zip(prompts, budgets):
            text, low, high = TOK.decode(prompt), 1, 15
            guesses = [int(g) for g in _guesses(text)]
            for guess, sign in zip(guesses, _signs(text)):
                low, high = (guess + 1, high) if sign == "+" else (low, guess - 1)
            tokens = ids(f"{(low + high) // 2}<eos>")[:budget]
            reason = "stop" if tokens[-1] == EOS else "length"
            logprobs = [-(1 + k) / 100 for k in range(len(tokens))]
            out.append([Completion(tokens, logprobs, reason) for _ in range(params.n)])
        return out


def _guesses(text: str) -> list[str]:
    return [part.split("<eos>")[0] for part in text.split("<assistant>")[1:] if "<eos>" in part]


def _signs(text: str) -> list[str]:
    return [part[0] for part in text.split("<user>")[2:]]


def rows(*secrets, modes=None):
    modes = modes or ["ok"] * len(secrets)
    return [
        {
            "prompt": [{"role": "user", "content": "?"}],
            "data_source": "user/guess",
            "reward_model": {"ground_truth": str(s)},
            "extra_info": {"index": i, "mode": m},
        }
        for i, (s, m) in enumerate(zip(secrets, modes))
    ]


def prompts(n: int) -> list[list[int]]:
    return [ids("<bos><user>?<assistant>") for _ in range(n)]


def params(**kw):
    return SamplingParams(**{"n": 2, "max_tokens": 40, "stop_token_ids": (EOS,), "seed": 1, **kw})


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "guess_env.py"
    path.write_text(ENV_FILE)
    return resolve_env(f"{path}:make")


def agent(env, timeout_s=2.0, **settings):
    settings = MultiTurnConfig(env="x", env_timeout_s=timeout_s, **{"max_turns": 4, **settings})
    return make_agent(Bisect(), TOK, None, settings, eos_token_ids=[EOS], env=env)


def test_the_protocol_checks_every_result():
    assert observation_messages("hi", what="step") == [{"role": "user", "content": "hi"}]
    assert observation_messages(None, what="step") == observation_messages("", what="step") == []
    tool = {"role": "tool", "name": "calc", "content": "3"}
    assert observation_messages([tool], what="step") == [tool]
    assert check_reset(("hello", None)) == ([{"role": "user", "content": "hello"}], {})
    step = check_step(("-", 1, True, False, {"a": 1}))
    assert (step.reward, step.terminated, step.truncated, step.info) == (1.0, True, False, {"a": 1})
    import numpy as np

    assert check_step(("+", np.float32(0.5), np.bool_(False), False, None)).reward == 0.5
    bad = [
        ("+", 0.0, False),  # Gymnasium's old 4-tuple, or anything short
        ("+", float("nan"), False, False, {}),
        ("+", float("inf"), False, False, {}),
        ("+", "1", False, False, {}),
        ("+", True, False, False, {}),  # a bool is no reward
        ("+", 0.0, "no", False, {}),
        ("+", 0.0, False, False, [1]),
        (7, 0.0, False, False, {}),
        ([{"role": "system", "content": "x"}], 0.0, False, False, {}),
        ([{"role": "user", "content": 3}], 0.0, False, False, {}),
        None,
    ]
    for result in bad:
        with pytest.raises(EnvError, match="step"):
            check_step(result)
    with pytest.raises(EnvError, match="reset must return"):
        check_reset("just text")


def test_resolve_env_by_file_module_and_name(user_env, tmp_path):
    assert callable(user_env) and user_env.__name__ == "make"
    assert resolve_env("otbrl.envs.builtin:make_guess") is BUILTIN_ENVS["guess"]
    assert resolve_env("guess", BUILTIN_ENVS) is BUILTIN_ENVS["guess"]
    for spec, match in (
        (f"{tmp_path}/missing.py:make", "does not exist"),
        ("otbrl.envs.builtin:nothing", "has no 'nothing'"),
        ("no_such_module_xyz:make", "cannot import module"),
        ("guess", "is not"),  # no built-ins given
    ):
        with pytest.raises(ValueError, match=match):
            resolve_env(spec)
    assert reset_seed({"extra_info": {"seed": 5, "index": 3}}) == 5
    assert reset_seed({"extra_info": {"index": 3}}) == 3
    row = {"prompt": [{"role": "user", "content": "?"}]}
    assert reset_seed(row) == reset_seed(dict(row)) != reset_seed({"prompt": "other"})


def test_runner_calls_plain_and_async_methods_under_a_timeout():
    runner = EnvRunner(0.3)

    async def nap(seconds):
        await asyncio.sleep(seconds)
        return "awake"

    def boom():
        raise ZeroDivisionError("x")

    def leave():
        raise SystemExit(3)

    async def main():
        assert await runner.call("step", lambda: 4) == 4
        assert await runner.call("step", nap, 0) == "awake"
        start = time.perf_counter()
        for fn, args, match in (
            (time.sleep, (5,), "did not return within 0.3 s"),
            (nap, (5,), "did not return within 0.3 s"),
            (boom, (), "raised ZeroDivisionError: x"),
            (leave, (), "raised RuntimeError: SystemExit"),
        ):
            with pytest.raises(EnvError, match=match):
                await runner.call("step", fn, *args)
        return time.perf_counter() - start

    assert asyncio.run(main()) < 2.0  # each hang cut at its timeout
    with pytest.raises(ValueError, match="timeout_s"):
        EnvRunner(0)
    # workers are reused from call to call (and from one event loop to the next); a call past
    # its timeout keeps its worker until it returns, and counts against max_hung meanwhile
    import threading

    runner = EnvRunner(0.2, max_hung=1)

    async def calls():
        await asyncio.gather(*(runner.call("step", lambda: 1) for _ in range(4)))

    for _ in range(4):
        asyncio.run(calls())
    assert runner.threads_started <= 4  # 16 calls, at most 4 at once: threads reused
    gate = threading.Event()

    async def hang_then_refuse():
        with pytest.raises(EnvError, match="did not return"):
            await runner.call("step", gate.wait)
        with pytest.raises(EnvError, match="1 earlier environment calls still run"):
            await runner.call("step", lambda: 1)
        gate.set()
        await asyncio.sleep(0.1)  # the hung call returns: its worker is free again
        return await runner.call("step", lambda: 2)

    assert asyncio.run(hang_then_refuse()) == 2


def test_the_stream_is_the_sampled_ids_and_the_observations(user_env):
    loop = agent(user_env)
    out = loop.generate(prompts(2), params(), rows=rows(7, 3))
    # secret 7: bisection guesses 8 (-), 4 (+), 6 (+), 7 (found) — four turns, three answers
    found, other = out[0]
    turns = [ids(f"{g}<eos>") for g in (8, 4, 6, 7)]
    answers = [loop.turns.observation_ids(t, [{"role": "user", "content": s}])
               for t, s in zip(turns, "-++")]  # fmt: skip
    assert answers == [ids(f"<user>{s}<assistant>") for s in "-++"]  # the template's own text
    stream = turns[0] + answers[0] + turns[1] + answers[1] + turns[2] + answers[2] + turns[3]
    assert found.token_ids == stream and other.token_ids == stream
    assert found.mask == [int(k % 2 == 0) for k, part in enumerate(
        [turns[0], answers[0], turns[1], answers[1], turns[2], answers[2], turns[3]]
    ) for _ in part]  # fmt: skip
    assert [lp for lp, m in zip(found.logprobs, found.mask) if m == 0] == [0.0] * 9
    # each step's reward on the last token of the turn it scored
    parts = [turns[0], answers[0], turns[1], answers[1], turns[2], answers[2], turns[3]]
    ends = [sum(len(p) for p in parts[: k + 1]) - 1 for k in (0, 2, 4, 6)]
    assert found.reward_positions == ends and found.rewards == [-0.125] * 3 + [1.0]
    assert (found.num_turns, found.env_error, found.retokenized) == (4, None, False)
    assert found.finish_reason == "stop"
    # secret 3: 8 (-), 4 (-), 2 (+), 3 found in the fourth turn too; the episodes end there
    assert out[1][0].rewards == [-0.125] * 3 + [1.0]


def test_max_turns_and_the_budget_end_an_episode(user_env):
    (group,) = agent(user_env, max_turns=2).generate(prompts(1), params(n=1), rows=rows(7))
    (episode,) = group
    assert episode.num_turns == 2 and episode.rewards == [-0.125, -0.125]
    assert episode.token_ids == ids("8<eos><user>-<assistant>4<eos>")  # no answer after the last
    # a budget that cuts the second answer: truncated, the row ends "length", no further step
    (group,) = agent(user_env).generate(prompts(1), params(n=1, max_tokens=4), rows=rows(7))
    assert group[0].token_ids == ids("8<eos><user>-") and group[0].finish_reason == "length"
    assert group[0].rewards == [-0.125]


def test_a_failing_environment_fails_its_sample_alone(user_env):
    modes = ["ok", "raises", "hangs", "garbage", "three", "make_raises", "reset_raises",
             "async_ok", "async_hangs"]  # fmt: skip
    start = time.perf_counter()
    out = agent(user_env, timeout_s=0.5).generate(
        prompts(len(modes)), params(n=1), rows=rows(*[7] * len(modes), modes=modes)
    )
    assert time.perf_counter() - start < 10  # the hangs cost their timeout, not 30 s
    errors = {m: g[0].env_error for m, g in zip(modes, out)}
    assert errors["ok"] is None and errors["async_ok"] is None
    assert out[0][0].rewards == out[7][0].rewards == [-0.125] * 3 + [1.0]
    assert "step raised RuntimeError: the simulator crashed" in errors["raises"]
    assert "did not return within 0.5 s" in errors["hangs"]
    assert "did not return within 0.5 s" in errors["async_hangs"]
    assert "finite" in errors["garbage"] and "step must return" in errors["three"]
    assert "make(row) raised ValueError: bad row" in errors["make_raises"]
    assert "reset raised KeyError" in errors["reset_raises"]
    # a failed sample keeps what it sampled before the failure (its first turn at least)
    assert out[1][0].token_ids[:3] == ids("8<eos><user>") and out[1][0].num_turns == 2


def test_sampling_scores_the_environment_and_zeroes_failures(user_env):
    modes = ["ok", "raises"]
    sample = sample_batch(
        agent(user_env), TOK, rows(7, 7, modes=modes), params(n=2),
        scoring=Scoring(function=lambda *a: 0.25),
    )  # fmt: skip
    batch = sample.batch
    assert batch["env_errors"].tolist() == [0, 0, 1, 1]
    # ok rows: the function's 0.25 on the last token, each step's reward on its turn's last token
    scores = batch["token_level_scores"]
    assert math.isclose(float(scores[0].sum()), 0.25 - 0.375 + 1.0, abs_tol=1e-6)
    assert scores[0][[1, 6, 11]].tolist() == [-0.125] * 3  # "8<eos>", "4<eos>", "6<eos>"
    assert math.isclose(float(scores[0][16]), 1.25, abs_tol=1e-6)
    assert (scores[2:] == 0).all() and sample.scores[2:] == [0.0, 0.0]
    assert math.isclose(sample.scores[0], 0.875, abs_tol=1e-6)
    assert sample.metrics["env/errors"] == 2.0
    assert sample.metrics["env/retokenization_mismatch"] == 0.0
    assert "the simulator crashed" in sample.rows[2]["extra_info"]["env_error"]
    assert "env_error" not in sample.rows[0]["extra_info"]


def test_guess_env_and_task():
    env = GuessEnv(5, 15)
    assert env.reset(seed=3) == (None, {})
    assert env.step("9")[:4] == ("-", 0.0, False, False)
    assert env.step(" 2 ")[:4] == ("+", 0.0, False, False)
    assert env.step("x")[:4] == ("?", 0.0, False, False)
    assert env.step("16")[0] == "?" and env.step("5")[:4] == (None, 1.0, True, False)
    rows_ = TASK.rows("val", 200, seed=0)
    assert {r["data_source"] for r in rows_} == {"otbrl/guess"}
    # demonstrations: consistent with the feedback, at most max_turns guesses, the secret found
    # in about 0.6 of them (random search inside the interval left)
    found = 0
    for row in rows_:
        demo = TASK.demonstration(row)
        secret, low, high = int(row["reward_model"]["ground_truth"]), 1, 15
        guesses = [int(t["content"]) for t in demo if t["role"] == "assistant"]
        assert 1 <= len(guesses) <= TASK.max_turns
        for g in guesses:
            assert low <= g <= high
            low, high = (g + 1, high) if secret > g else (low, g - 1) if g > secret else (g, g)
        found += guesses[-1] == secret
    assert 0.45 < found / len(rows_) < 0.75
    with pytest.raises(ValueError, match="high"):
        get_task("guess", high=1)


def test_failing_environments_fail_their_samples_from_the_cli(user_env, tmp_path, capsys):
    """``otbrl train`` with an environment that raises, hangs or returns garbage on some rows:
    the run finishes, those samples are counted and scored 0, the logged generations say why."""
    from otbrl import cli
    from otbrl.data import write_parquet_rows
    from otbrl.models import build_tiny_model
    from run_utils import read_metrics, train_overrides
    from tiny_models import ONE_LAYER

    model = build_tiny_model(tmp_path / "model", task="guess", **ONE_LAYER)
    modes = ["ok", "make_raises", "hangs", "garbage"]
    train = write_parquet_rows(rows(*range(1, 9), modes=modes * 2), tmp_path / "train.parquet")
    # validation samples greedily: a random model's turns seldom end, so its environments fail
    # before the first step
    val_modes = ["ok", "reset_raises", "reset_hangs", "reset_garbage"]
    val = write_parquet_rows(rows(7, 7, 7, 7, modes=val_modes), tmp_path / "val.parquet")
    env = user_env.__code__.co_filename
    out = tmp_path / "run"
    argv = ["train", *train_overrides(
        model, out, f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"rollout.multi_turn.env={env}:make", "rollout.multi_turn.env_timeout_s=0.5",
        "rollout.multi_turn.max_turns=3", "data.max_response_length=16", "rollout.n=2",
        "trainer.total_steps=2", "trainer.val_every=2", "trainer.log_generations=4",
        "algorithm.adv_estimator=tir_optimal_token_baseline",
    )]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().err[-3000:]
    steps = [r for r in read_metrics(out) if "policy/grad_norm" in r]
    # of 8 samples a step: make_raises's 2 always; "garbage" and "hangs" where a turn ended
    assert len(steps) == 2 and all(r["env/errors"] >= 2 for r in steps)
    logged = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    why = {g.get("env_error", "") for g in logged}
    assert any("did not return within 0.5 s" in w for w in why), why
    assert any("reset must return" in w for w in why), why
    assert any("reset raised KeyError" in w for w in why), why
    assert all(g["reward"] == 0.0 for g in logged if g.get("env_error"))


def test_an_opening_observation_joins_the_prompt(tmp_path):
    """``reset``'s observation is the prompt's last user turn (once per row, before encoding);
    every sample's environment must open alike, or that sample fails saying so."""

    class Opening:
        def __init__(self, row):
            self.row = row

        def reset(self, seed=None, options=None):
            if self.row["extra_info"]["mode"] == "fickle":
                Opening.count = getattr(Opening, "count", 0) + 1
                return str(Opening.count % 7), {}
            return "7", {}

        def step(self, action):
            return None, 1.0, True, False, {}

    loop = agent(Opening)
    opened = loop.prompt_rows(rows(7, 7, modes=["ok", "fickle"]))
    assert opened[0]["prompt"][-1] == {"role": "user", "content": "7"}
    assert opened[0]["env_opening"] == 1 and opened[0]["prompt"][0]["content"] == "?"
    sample = sample_batch(loop, TOK, rows(7, 7, modes=["ok", "fickle"]), params(n=2),
                          scoring=Scoring(function=lambda *a: 0.0))  # fmt: skip
    # the prompt ids hold the opening as a user turn, then the generation prompt
    assert TOK.decode(sample.batch["prompts"][0][sample.batch["prompts"][0] != TOK.pad_token_id]
                      .tolist()).endswith("<user>?<user>7<assistant>")  # fmt: skip
    assert sample.batch["env_errors"].tolist() == [0, 0, 1, 1]
    assert "opened the episode otherwise" in sample.rows[2]["extra_info"]["env_error"]
    assert sample.scores[:2] == [1.0, 1.0]


def test_an_environment_run_resumes_exactly(tmp_path):
    """A run stopped at its step-2 checkpoint and resumed to step 4 logs the metrics and ends
    with the weights of the run that went straight to step 4: the environments' seeds come from
    the rows, nothing of an episode outlives its step."""
    from safetensors.torch import load_file

    from otbrl import cli
    from otbrl.data import write_parquet_rows
    from otbrl.models import build_tiny_model
    from run_utils import stable_metrics, train_overrides
    from tiny_models import ONE_LAYER

    model = build_tiny_model(tmp_path / "model", task="guess", **ONE_LAYER)
    task = get_task("guess")
    train = write_parquet_rows(task.rows("train", 32, seed=0), tmp_path / "train.parquet")
    val = write_parquet_rows(task.rows("val", 8, seed=0), tmp_path / "val.parquet")

    def run(out, steps):
        return cli.main(["train", *train_overrides(
            model, out, f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            "rollout.multi_turn.env=guess", "rollout.multi_turn.max_turns=4",
            "data.max_response_length=24", f"trainer.total_steps={steps}", "trainer.save_every=2",
            "trainer.val_every=2", "trainer.resume=auto",
            "algorithm.adv_estimator=tir_optimal_token_baseline",
        )])  # fmt: skip

    assert run(tmp_path / "full", 4) == 0
    assert run(tmp_path / "split", 2) == 0 and run(tmp_path / "split", 4) == 0
    assert stable_metrics(tmp_path / "split") == stable_metrics(tmp_path / "full")
    a, b = (load_file(tmp_path / d / "checkpoints" / "step_4" / "model.safetensors")
            for d in ("full", "split"))  # fmt: skip
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_estimator_trains_on_an_environment(tmp_path):
    """One step of each registered estimator on the guess environment from the CLI (GAE with
    its critic): finite losses, the environment's rewards in the batch."""
    from otbrl import cli
    from otbrl.algos.advantages import ESTIMATORS
    from otbrl.data import write_parquet_rows
    from otbrl.models import build_tiny_model
    from run_utils import read_metrics, train_overrides
    from tiny_models import ONE_LAYER

    model = build_tiny_model(tmp_path / "model", task="guess", **ONE_LAYER)
    task = get_task("guess")
    train = write_parquet_rows(task.rows("train", 8, seed=0), tmp_path / "train.parquet")
    val = write_parquet_rows(task.rows("val", 4, seed=0), tmp_path / "val.parquet")
    for name in sorted(ESTIMATORS):
        out = tmp_path / name
        extra = ["critic.enable=true"] if "values" in ESTIMATORS[name].needs_for() else []
        code = cli.main(["train", *train_overrides(
            model, out, f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            "rollout.multi_turn.env=guess", "data.max_response_length=16",
            "trainer.total_steps=1", "trainer.val_every=0", f"algorithm.adv_estimator={name}",
            *extra,
        )])  # fmt: skip
        assert code == 0, name
        (step,) = [r for r in read_metrics(out) if "policy/grad_norm" in r]
        assert math.isfinite(step["policy/loss"]) and "env/reward_mean" in step, name
