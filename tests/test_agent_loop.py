"""The agent loop driven by a scripted fake engine: masks, observation placement and tokens,
the budget, the turn limit and every kind of error observation; the batch it makes; TIR-OTB on
such batches against the per-row loop reference; the answer decoding and reward placement with
holes."""

import torch

from otbrl.algos import compute_advantage
from otbrl.data import get_task
from otbrl.models import build_tokenizer
from otbrl.rewards.placement import place_scores
from otbrl.rollout import (
    AgentLoop,
    Completion,
    SamplingParams,
    completions_to_batch,
    decode_responses,
    decode_transcripts,
    left_pad,
    make_agent,
    tool_metrics,
)
from otbrl.rollout.config import MultiTurnConfig
from otbrl.tools import resolve_tools
from test_advantages_otb import reference

TASK = get_task("tool_arithmetic")
TOK = build_tokenizer(TASK.alphabet, tool_tokens=True)
EOS = TOK.eos_token_id
SLOW_TOOLS = '''
import time

def nap(seconds: str) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(float(seconds))
    return "awake"

def boom(x: str) -> str:
    """Fails.

    Args:
        x: ignored
    """
    raise RuntimeError("kaput")
'''


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class ScriptedEngine:
    """A RolloutBackend whose turns come from ``script(context, sample, turn)`` (text; turn =
    the observations in the context so far); the turn is cut at the first stop id (kept) or at
    its budget, like the real backends.
    Log-probs are -(1 + position in the turn) / 100, so their placement can be checked."""

    name = "scripted"

    def __init__(self, script):
        self.script, self.calls, self.contexts = script, [], []

    def generate(self, prompts, params, *, max_tokens=None):
        self.calls.append((len(prompts), params))
        budgets = [params.max_tokens] * len(prompts) if max_tokens is None else list(max_tokens)
        out = []
        for prompt, budget in zip(prompts, budgets):
            self.contexts.append(list(prompt))
            group = []
            for j in range(params.n):
                turn = TOK.decode(prompt).count("<tool_response>")
                tokens = ids(self.script(list(prompt), j, turn))
                cut = next(
                    (k + 1 for k, t in enumerate(tokens) if t in params.stop_token_ids), None
                )
                reason = "stop" if cut is not None and cut <= budget else "length"
                tokens = tokens[: cut if reason == "stop" else budget]
                group.append(
                    Completion(tokens, [-(1 + k) / 100 for k in range(len(tokens))], reason)
                )
            out.append(group)
        return out


def agent_for(script, tools=("calculator",), **kw):
    engine = ScriptedEngine(script)
    settings = MultiTurnConfig(**{"max_turns": 3, **kw})
    agent = make_agent(engine, TOK, resolve_tools(list(tools)), settings, eos_token_ids=[EOS])
    return engine, agent


def prompts(*texts):
    return [ids(f"<bos><user>{t}<assistant>") for t in texts]


def params(**kw):
    return SamplingParams(**{"n": 2, "max_tokens": 32, "stop_token_ids": (EOS,), "seed": 3, **kw})


def tool_then_answer(prompt, sample, turn):
    """Sample 0 answers directly; sample 1 calls the calculator, then copies the result."""
    question = TOK.decode(prompt).split("<user>")[1].split("=")[0]
    if sample == 0 and turn == 0:
        return "123<eos>"
    if turn == 0:
        return f"<tool_call>{question}</tool_call>ignored"
    return TOK.decode(prompt).split("<tool_response>")[-1].split("</tool_response>")[0] + "<eos>"


def test_masks_observation_tokens_and_order():
    engine, agent = agent_for(tool_then_answer)
    out = agent.generate(prompts("1234*56=", "12*3="), params())
    assert [len(g) for g in out] == [2, 2]
    direct, tool = out[0]
    assert direct.token_ids == ids("123<eos>") and direct.mask == [1] * 4 and direct.num_turns == 1
    call = ids("<tool_call>1234*56</tool_call>")
    observation = ids("<tool_response>69104</tool_response><assistant>")
    answer = ids("69104<eos>")
    assert tool.token_ids == call + observation + answer  # one stream, "ignored" never sampled
    assert tool.mask == [1] * len(call) + [0] * len(observation) + [1] * len(answer)
    assert tool.logprobs[len(call) : len(call) + len(observation)] == [0.0] * len(observation)
    assert tool.logprobs[: len(call)] == [-(1 + k) / 100 for k in range(len(call))]
    assert (tool.num_turns, tool.tool_calls, tool.tool_errors) == (2, 1, 0)
    assert tool.finish_reason == "stop" and out[1][1].token_ids[-len(ids("36<eos>")) :] == ids(
        "36<eos>"
    )
    # first turn: n per prompt, the call-end token added to the stops; then n = 1 per live row
    (first_p, first), (later_p, later) = engine.calls
    assert (
        first_p == 2
        and first.n == 2
        and TOK.convert_tokens_to_ids("</tool_call>") in (first.stop_token_ids)
    )
    assert later_p == 2 and later.n == 1 and later.seed != first.seed
    # the second turn saw the prompt, the call and the observation
    assert engine.contexts[-2] == prompts("1234*56=")[0] + call + observation


def test_batch_from_trajectories_and_the_fixes_with_holes():
    _, agent = agent_for(tool_then_answer)
    p = prompts("1234*56=", "12*3=")
    out = agent.generate(p, params())
    prompt_ids, prompt_mask = left_pad(p, TOK.pad_token_id)
    batch = completions_to_batch(prompt_ids, prompt_mask, out, pad_id=TOK.pad_token_id)
    mask, attention = batch["response_mask"], batch["attention_mask"][:, prompt_ids.shape[1] :]
    lengths = [len(t.token_ids) for g in out for t in g]
    assert attention.sum(1).tolist() == lengths  # every real token is attended, holes included
    assert mask.sum(1).tolist() == [sum(t.mask) for g in out for t in g]
    assert batch["num_turns"].tolist() == [1, 2, 1, 2] and batch["tool_calls"].tolist() == [
        0,
        1,
        0,
        1,
    ]
    assert batch["uid"].tolist() == [0, 0, 1, 1]
    # decoding: the final answer after the last observation, the transcript has all of it
    assert decode_responses(TOK, batch["responses"], mask) == ["123", "69104", "123", "36"]
    transcript = decode_transcripts(TOK, batch["responses"], attention)[1]
    assert transcript == "<tool_call>1234*56</tool_call><tool_response>69104</tool_response>" + (
        "<assistant>69104<eos>"
    )
    # reward on the last model token, after the holes
    scores = place_scores(torch.tensor([0.0, 1.0, 0.0, 1.0]), mask)
    last = [max(t for t in range(mask.shape[1]) if mask[r, t] > 0) for r in range(4)]
    assert [float(scores[r, t]) for r, t in enumerate(last)] == [0.0, 1.0, 0.0, 1.0]
    assert float(scores.sum()) == 2.0
    metrics = tool_metrics(batch)
    assert metrics["tool/calls_per_sample"] == 0.5 and metrics["tool/rows_with_holes_frac"] == 0.5
    observed = float((attention.float() - mask).sum()) / float(attention.sum())
    assert metrics["rollout/observation_tokens_frac"] == observed > 0


def test_budget_truncates_an_observation_and_ends_the_row():
    call = len(ids("<tool_call>1234*56</tool_call>"))
    _, agent = agent_for(tool_then_answer)
    (group,) = agent.generate(prompts("1234*56="), params(max_tokens=call + 3))
    tool = group[1]
    assert len(tool.token_ids) == call + 3 and tool.mask == [1] * call + [0] * 3
    assert tool.finish_reason == "length" and tool.num_turns == 1 and tool.tool_calls == 1
    # exactly the observation's room: nothing left for the model, the row ends as well
    obs = len(ids("<tool_response>69104</tool_response><assistant>"))
    (group,) = agent.generate(prompts("1234*56="), params(max_tokens=call + obs))
    assert group[1].finish_reason == "length" and group[1].mask[-1] == 0
    # per-prompt budgets
    out = agent.generate(prompts("1234*56=", "1234*56="), params(), max_tokens=[4, call + 3])
    assert len(out[0][1].token_ids) == 4 and out[0][1].finish_reason == "length"
    assert len(out[1][1].token_ids) == call + 3


def test_tool_results_are_cut_to_max_observation_tokens():
    _, agent = agent_for(tool_then_answer, max_observation_tokens=3)
    (group,) = agent.generate(prompts("1234*56="), params())
    assert ids("<tool_response>691</tool_response><assistant>") == [
        t for t, m in zip(group[1].token_ids, group[1].mask) if m == 0
    ]


def test_a_huge_tool_output_is_cut_by_characters_before_it_is_tokenized(monkeypatch):
    """A tool that prints megabytes: the trainer tokenizes a prefix of it (on main the whole
    output was encoded, then cut)."""
    turns = agent_for(tool_then_answer, max_observation_tokens=3)[1].turns
    seen = []
    encode = turns.tokenizer.encode
    monkeypatch.setattr(
        turns.tokenizer, "encode", lambda t, **k: seen.append(len(t)) or encode(t, **k)
    )
    assert turns.truncate("1234" * 2_000_000, 3) == "123"
    assert max(seen) < 1000


def test_turn_limit():
    def always_call(prompt, sample, turn):
        return "<tool_call>1+1</tool_call>"

    _, agent = agent_for(always_call, max_turns=3)
    (group,) = agent.generate(prompts("1+1="), params(n=1))
    (row,) = group
    assert row.num_turns == 3 and row.tool_calls == 2  # the third call is never answered
    assert row.finish_reason == "stop" and row.mask[-1] == 1


def test_error_observations_are_counted_and_the_run_goes_on(tmp_path):
    path = tmp_path / "slow.py"
    path.write_text(SLOW_TOOLS)
    bodies = {
        0: "calculator:1/0",  # raises
        1: "boom:x",  # a user tool that raises
        2: "nap:3",  # sleeps past the timeout
        3: "search:cats",  # unknown tool
        4: 'calculator:{"expression": ',  # bad JSON arguments
        5: "1+1",  # no name with several tools
    }

    def script(prompt, sample, turn):
        if turn == 0:
            return f"<tool_call>{bodies[sample]}</tool_call>"
        return "7<eos>"

    tools = ["calculator", f"{path}:boom", f"{path}:nap"]
    _, agent = agent_for(script, tools=tools, tool_timeout_s=0.3)
    (group,) = agent.generate(prompts("1+1="), params(n=6, max_tokens=200))
    texts = [TOK.decode([t for t, m in zip(r.token_ids, r.mask) if m == 0]) for r in group]
    assert all(r.tool_errors == 1 and r.tool_calls == 1 and r.num_turns == 2 for r in group)
    assert "calculator raised ZeroDivisionError: division by zero" in texts[0]
    assert "boom raised RuntimeError: kaput" in texts[1]
    assert "timed out after 0.3 s" in texts[2]
    assert "unknown tool 'search'" in texts[3]
    assert "not valid JSON" in texts[4]
    assert "name the tool" in texts[5]
    assert all(r.token_ids[-2:] == ids("7<eos>") for r in group)


def test_allowed_tools_per_prompt_and_single_turn_equivalence():
    def call_or_answer(prompt, sample, turn):
        return "<tool_call>2*3</tool_call>" if turn == 0 and sample == 1 else "6<eos>"

    _, agent = agent_for(call_or_answer)
    no_tools = {"extra_info": {"tools": []}}  # this row names no tool: its calls are refused
    out = agent.generate(prompts("2*3=", "2*3="), params(), rows=[no_tools, {}])
    assert out[0][1].tool_errors == 1 and out[1][1].tool_errors == 0
    # a model that never calls: exactly the engine's single-turn completions
    engine = ScriptedEngine(lambda p, s, t: "12<eos>")
    loop = AgentLoop(engine, agent.turns, agent.make_env, tools=agent.tools)
    single = engine.generate(prompts("2*3="), params(stop_token_ids=tuple(agent.turns.stop_ids)))
    (group,) = loop.generate(prompts("2*3="), params())
    assert [(r.token_ids, r.logprobs, r.finish_reason) for r in group] == [
        (c.token_ids, c.logprobs, c.finish_reason) for c in single[0]
    ]
    assert all(r.mask == [1] * len(r.token_ids) for r in group)


def test_tir_otb_on_agent_loop_batches_matches_the_loop_reference():
    """Groups mixing rows with and without holes (the case TIR-OTB aligns)."""

    def script(prompt, sample, turn):
        if turn == 0:  # even samples answer, odd ones call with their number as the expression
            return f"{sample}<eos>" if sample % 2 == 0 else f"<tool_call>{sample}</tool_call>"
        text = TOK.decode(prompt)
        s = int(text.split("<tool_call>")[1].split("</tool_call>")[0])
        if s == 3 and turn < 2:
            return "<tool_call>1+1</tool_call>"  # sample 3 calls twice: two holes
        return "5" * (1 + s) + "<eos>"

    _, agent = agent_for(script, max_turns=3)
    p = prompts("12*3=", "7*8=", "99*99=")
    out = agent.generate(p, params(n=6))
    prompt_ids, prompt_mask = left_pad(p, TOK.pad_token_id)
    batch = completions_to_batch(prompt_ids, prompt_mask, out, pad_id=TOK.pad_token_id)
    mask = batch["response_mask"]
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(mask.shape, generator=g) * mask
    spp = (torch.rand(mask.shape, generator=g) * 0.5 + old.exp() ** 2).clamp(max=1) * mask
    scores = torch.rand(mask.shape[0], generator=g).round()
    rewards = place_scores(scores, mask)
    adv, ret = compute_advantage(
        "tir_optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
        index=batch["uid"], old_log_probs=old, sum_pi_squared=spp,
    )  # fmt: skip
    assert (adv[mask == 0] == 0).all()
    first = mask.argmax(dim=1)
    assert torch.equal(ret[torch.arange(mask.shape[0]), first], scores)
    want, _ = reference(
        {"token_level_rewards": rewards, "response_mask": mask, "index": batch["uid"].tolist(),
         "old_log_probs": old, "sum_pi_squared": spp},
        tir=True,
    )  # fmt: skip
    torch.testing.assert_close(adv.double(), want, atol=1e-5, rtol=1e-5)
    holes = tool_metrics(batch)["tool/rows_with_holes_frac"]
    assert 0 < holes < 1
