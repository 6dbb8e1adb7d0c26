"""The per-trajectory agent loop (``rollout.mode=server``): each sample's turns run on their
own, so a slow tool call holds up only its own trajectory. A tool that sleeps 2 s on exactly one
of each trajectory's three calls (a different turn for each trajectory): the turn-synchronous
loop pays one slow call per turn (~6 s), the per-trajectory loop about one (~2 s)."""

from __future__ import annotations

import threading
import time

from otbrl.rollout import Completion, SamplingParams, make_agent
from otbrl.rollout.config import MultiTurnConfig
from otbrl.tools import resolve_tools
from test_agent_loop import EOS, TOK, ids

SLEEPY = '''
import threading
import time

_lock = threading.Lock()
_calls = {}

def sleepy(who: str) -> str:
    """Sleeps 2 s on one call of each caller.

    Args:
        who: the trajectory
    """
    with _lock:
        k = _calls.get(who, 0)
        _calls[who] = k + 1
    if k == int(who):
        time.sleep(2.0)
    return "ok"
'''


class CallingEngine:
    """Thread-safe fake backend: sample j of a prompt calls ``sleepy(j)`` on each of its first
    three turns, then answers; every generate call takes 10 ms."""

    name = "fake-server"

    def __init__(self):
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0

    def generate(self, prompts, params, *, max_tokens=None):
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(0.01)
        out = []
        for prompt in prompts:
            group = []
            text = TOK.decode(prompt)
            turn = text.count("<tool_response>")
            for j in range(params.n):
                who = j if turn == 0 else int(text.split("<tool_call>")[1][0])
                reply = f"<tool_call>{who}</tool_call>" if turn < 3 else "7<eos>"
                tokens = ids(reply)
                group.append(Completion(tokens, [-0.1] * len(tokens), "stop"))
            out.append(group)
        with self.lock:
            self.in_flight -= 1
        return out


def _rollout(tmp_path, name, per_trajectory, **kw):
    path = tmp_path / f"sleepy_{name}.py"  # a module of its own: fresh call counts
    path.write_text(SLEEPY)
    engine = CallingEngine()
    agent = make_agent(
        engine, TOK, resolve_tools([f"{path}:sleepy"]),
        MultiTurnConfig(format="compact", max_turns=4, tool_timeout_s=10.0), eos_token_ids=[EOS],
        per_trajectory=per_trajectory, **kw,
    )  # fmt: skip
    prompt = [ids("<bos><user>1+2=<assistant>")]
    params = SamplingParams(n=3, max_tokens=200, stop_token_ids=(EOS,), seed=0)
    start = time.perf_counter()
    out = agent.generate(prompt, params)
    return time.perf_counter() - start, out, engine


def test_a_slow_call_holds_up_only_its_own_trajectory(tmp_path):
    synchronous, sync_out, _ = _rollout(tmp_path, "a", False)
    apart, out, engine = _rollout(tmp_path, "b", True)
    assert synchronous >= 6.0  # one slow call on every one of the three turns
    assert apart <= 0.5 * synchronous, (apart, synchronous)
    # the same trajectories either way: three calls, then the answer
    for a, b in zip(sync_out[0], out[0]):
        assert (a.num_turns, a.tool_calls) == (b.num_turns, b.tool_calls) == (4, 3)
        assert a.token_ids == b.token_ids and a.mask == b.mask
    assert engine.most_in_flight >= 2  # the trajectories' turns really overlapped


def test_max_concurrent_trajectories_bounds_the_load(tmp_path):
    _, out, engine = _rollout(tmp_path, "c", True, max_concurrent_trajectories=1)
    assert engine.most_in_flight == 1
    assert [t.tool_calls for t in out[0]] == [3, 3, 3]
