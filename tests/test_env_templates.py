"""Exact tokens under every zoo chat template: in an environment's episode the ids the trainer
trains on are the ids the engine sampled plus the observations' ids — each observation the
template's own text between two turns, written out by hand per template here (an independent
reference, not the suffix difference the loop computes) — whatever the template does to earlier
turns when it re-renders a conversation. Re-rendering the final conversation is compared and a
difference counted (``retokenized``), never trained; a template that rewrites history is
refused at start naming the model."""

import pytest

from otbrl import cli
from otbrl.data import tokenize_prompts, write_parquet_rows
from otbrl.rollout import Completion, SamplingParams, make_agent
from otbrl.rollout.config import MultiTurnConfig
from user_model import byte_level_tokenizer
from zoo import CHATML, QWEN, ZOO, ZOO_NAMES, build_standin

# Qwen3's rule, written for this test: an assistant turn before the last user message loses
# its <think> block when the conversation is rendered again
QWEN3_THINKING = (
    "{%- set last = namespace(user=-1) %}"
    "{%- for m in messages %}{% if m['role'] == 'user' %}{% set last.user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 < last.user and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1].lstrip('\n') }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {**{name: ZOO[name] for name in ZOO_NAMES}}
TEMPLATES["qwen3-thinking"] = {**ZOO["qwen3"], "template": QWEN3_THINKING}
# the text each template writes after a model turn (its EOS sampled) for a user message, up to
# the next generation prompt
BETWEEN = {
    "qwen2.5": "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "qwen3-thinking": "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "llama3.2": (
        "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "mistral": "[INST] {} [/INST]",
    "gemma": "\n<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n",
}
TURNS = ["<think>\nfirst try the middle</think>\nI guess 8.", "Then 4.", "It is 6."]
ANSWERS = ["lower", "higher"]


def tokenizer(name):
    spec = TEMPLATES[name]
    return byte_level_tokenizer(
        spec["specials"], eos=spec["eos"], pad=spec["pad"], bos=spec["bos"],
        chat_template=spec["template"],
    )  # fmt: skip


class Replay:
    """A RolloutBackend that answers turn k of every row with ``turns[k]`` (ids, as given)."""

    name = "replay"

    def __init__(self, turns):
        self.turns, self.seen = turns, []

    def generate(self, prompts, params, *, max_tokens=None):
        out = []
        for prompt in prompts:
            self.seen.append(list(prompt))
            k = sum(1 for p in self.seen if p[: len(self.seen[0])] == self.seen[0]) - 1
            ids = self.turns[min(k, len(self.turns) - 1)]
            out.append([Completion(ids, [-0.25] * len(ids), "stop") for _ in range(params.n)])
        return out


class Answers:
    """Answers the first turns with the row's ``extra_info.answers``, then ends the episode."""

    def __init__(self, row):
        self.k, self.answers = 0, row["extra_info"]["answers"]

    def reset(self, seed=None, options=None):
        return None, {}

    def step(self, action):
        self.k += 1
        if self.k > len(self.answers):
            return None, 1.0, True, False, {}
        return self.answers[self.k - 1], 0.0, False, False, {}


def episode(name, turn_ids, answers=ANSWERS):
    tok = tokenizer(name)
    row = {"prompt": [{"role": "user", "content": "Guess my number."}], "data_source": "x",
           "extra_info": {"answers": answers}}  # fmt: skip
    (prompt,) = tokenize_prompts([row], tok)
    settings = MultiTurnConfig(env="answers", max_turns=4, max_observation_tokens=64)
    agent = make_agent(Replay(turn_ids), tok, None, settings, eos_token_ids=[tok.eos_token_id],
                       model=name, env=Answers)  # fmt: skip
    params = SamplingParams(n=1, max_tokens=400, stop_token_ids=(tok.eos_token_id,))
    ((trajectory,),) = agent.generate([prompt], params, rows=[row])
    return tok, prompt, trajectory


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_trained_ids_are_the_sampled_ids_and_the_observations(name):
    tok = tokenizer(name)
    turn_ids = [[*tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in TURNS]
    before, after = BETWEEN[name].split("{}")
    assert after  # an answer ends with the next generation prompt
    # the second answer prints the template's own markers: data, kept as text
    for answers in (ANSWERS, ["lower", f"higher{BETWEEN[name].format('x')}"]):
        tok, _prompt, trajectory = episode(name, turn_ids, answers)
        expected = [
            tok.encode(before, add_special_tokens=False)
            + tok.encode(a, add_special_tokens=False, split_special_tokens=True)
            + tok.encode(after, add_special_tokens=False)
            for a in answers
        ]
        parts = [turn_ids[0], expected[0], turn_ids[1], expected[1], turn_ids[2]]
        assert trajectory.token_ids == [t for part in parts for t in part]
        assert trajectory.mask == [1 - k % 2 for k, part in enumerate(parts) for _ in part]
        assert trajectory.logprobs == [-0.25 * (1 - k % 2) for k, p in enumerate(parts) for _ in p]
        assert trajectory.rewards == [0.0, 0.0, 1.0] and trajectory.env_error is None
        specials = set(tok.all_special_ids)
        assert sum(t in specials for t in expected[1]) == sum(t in specials for t in expected[0])
        # re-rendering the conversation gives the same ids, except where the template drops
        # the first turn's reasoning, or its tokenizer reads the printed markers as its own
        assert trajectory.retokenized == (name == "qwen3-thinking" or answers is not ANSWERS)


@pytest.mark.parametrize("name", [QWEN, "mistral"])
def test_a_turn_tokenized_otherwise_is_kept_and_counted(name):
    """A sampled turn in ids the tokenizer would not produce for its text (one byte per token)
    is trained as sampled; re-rendering gives other ids, so the sample is counted."""
    tok = tokenizer(name)
    merged = tok.encode("the quick brown fox", add_special_tokens=False)
    single = [i for t in merged for i in tok.encode(tok.decode([t]), add_special_tokens=False)]
    bytewise = [tok.convert_tokens_to_ids(c) for c in tok.convert_ids_to_tokens(merged)]
    assert len(merged) < len(single) or bytewise  # the corpus merges these words
    split = [tok.convert_tokens_to_ids(c) for tok_text in tok.convert_ids_to_tokens(merged)
             for c in tok_text]  # fmt: skip
    assert tok.decode(split) == tok.decode(merged) and split != merged
    turns = [[*split, tok.eos_token_id]] + [
        [*tok.encode(t, add_special_tokens=False), tok.eos_token_id] for t in TURNS[1:]
    ]
    tok, _prompt, trajectory = episode(name, turns)
    assert trajectory.token_ids[: len(split) + 1] == turns[0] and trajectory.retokenized


def test_a_template_that_rewrites_history_is_refused_naming_the_model(tmp_path, capsys):
    hiding = CHATML.replace(
        "{{ message['content'] }}",
        "{% if message['role'] == 'assistant' and not loop.last %}(hidden)"
        "{% else %}{{ message['content'] }}{% endif %}",
    )
    tok = byte_level_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                               eos="<|im_end|>", chat_template=hiding)  # fmt: skip
    settings = MultiTurnConfig(env="answers")
    with pytest.raises(ValueError, match=r"model 'my/model'.*not prefix-preserving"):
        make_agent(None, tok, None, settings, eos_token_ids=[tok.eos_token_id], model="my/model",
                   env=Answers)  # fmt: skip
    # from the command line: one line naming the model's path, before any model loads
    model = build_standin(QWEN, tmp_path / "model")
    tok.save_pretrained(model)  # the stand-in's weights with the rewriting template
    capsys.readouterr()  # the stand-in's own save progress
    env = tmp_path / "env.py"
    env.write_text("def make(row):\n    raise AssertionError('never made')\n")
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "data_source": "x",
             "reward_model": {"ground_truth": "1"}, "extra_info": {"index": 0}}] * 4  # fmt: skip
    data = write_parquet_rows(rows, tmp_path / "train.parquet")
    code = cli.main(["train", f"model.path={model}", f"data.train_files=[{data}]",
                     f"rollout.multi_turn.env={env}:make", f"trainer.output_dir={tmp_path / 'r'}",
                     "data.train_batch_size=4"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "'model.path'" in err[0] and str(model) in err[0] and "prefix-preserving" in err[0]
