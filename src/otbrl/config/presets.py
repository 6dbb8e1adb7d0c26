"""Presets: the settings the built-in model and tasks were tuned with, laid under the user's.

The schema's defaults are for a user's model (a 0.5 B–8 B HF model on real data: the field's
learning rate, response budget and batch sizes). The built-in model (~0.66 M parameters, a
character vocabulary) and its tasks are tuned differently — a learning rate 300 times higher, a
4-token response budget — and those settings must never leak into a real run. So each lives in
a preset that ``load_config`` puts between the schema's defaults and the user's config file and
overrides (which always win), selected by what the run uses:

- ``MODEL_PRESETS["builtin"]``: ``model.path=builtin`` (its sizes: learning rates, micro-batches);
- ``TASK_PRESETS[task]``: the data comes from the built-in task ``data.task`` (no
  ``data.train_files``): its prompt and response budgets, and for ``tool_arithmetic`` its tools.

``train``, ``eval``, ``sft``, ``demo``, ``compare`` and ``variance`` all load through
``load_config``, so they all see the same presets; ``otbrl train --print-config`` shows the
result.
"""

from __future__ import annotations

# the built-in model's own sizes (also what its tasks' presets start from: a built-in task is
# learnable in minutes only by a model that small)
_TINY_MODEL = [
    "actor.lr=3e-4",
    "critic.lr=1e-3",
    "actor.micro_batch_size=64",
    "critic.micro_batch_size=64",
    "trainer.val_batch_size=256",
]

MODEL_PRESETS: dict[str, list[str]] = {"builtin": _TINY_MODEL}

_TASK_BASE = [
    *_TINY_MODEL,
    "data.max_prompt_length=64",
    "data.max_response_length=4",  # 3 answer digits + EOS
    "trainer.save_every=0",  # a minutes-long run: no checkpoints unless asked for
]

TASK_PRESETS: dict[str, list[str]] = {
    "arithmetic": _TASK_BASE,
    "digit_sum": _TASK_BASE,
    # only learnable with its tool, and its answers are multi-turn: the calculator on, the
    # response budget sized for call + observation + answer, TIR-OTB, and a warm start stopped
    # early enough that the policy uses the tool only sometimes
    "tool_arithmetic": [
        *_TASK_BASE,
        "rollout.multi_turn.tools=[calculator]",
        "rollout.multi_turn.max_turns=3",
        "rollout.multi_turn.max_observation_tokens=16",
        "data.max_response_length=32",
        "algorithm.adv_estimator=tir_optimal_token_baseline",
        "sft.target_accuracy=0.3",
        "sft.eval_every=25",
        # its accuracy climbs gradually at 3e-3 (0.34 after 1275 steps on an AMD EPYC) but
        # jumps past the target at 1e-3 (0.62 at step 123, every prompt already calling)
        "sft.lr=3e-3",
        # without warmup and clipping lr 3e-3 is chaotic here (one seed stalled at 0.004 for
        # 2000 steps); with them five seeds reached the target in 100-125 steps
        "sft.warmup_steps=20",
        "sft.grad_clip=1.0",
        # the gain comes within ~50 steps (0.35 -> 0.80 measured): 300 steps leave a margin
        "trainer.total_steps=300",
    ],
    # multi-turn with an environment: up to 4 guesses (2 digits + EOS) and 3 answers
    # (<user> sign <assistant>) in the response budget; TIR-OTB (the answers are holes)
    "guess": [
        *_TASK_BASE,
        "rollout.multi_turn.env=guess",
        "rollout.multi_turn.max_turns=4",
        "rollout.multi_turn.max_observation_tokens=4",
        "data.max_response_length=24",
        "algorithm.adv_estimator=tir_optimal_token_baseline",
        "sft.target_accuracy=0.4",
        "sft.eval_every=25",
    ],
    # long responses (46-135 tokens of steps + answer): the response budget holds the longest
    # answer the task can have (26 items, every total written)
    "chain_sum": [
        *_TASK_BASE,
        "data.max_response_length=136",
        # from its warm start (0.41 greedy) 3e-4 rose, then collapsed (OTB 0.655 -> 0.30,
        # GRPO -> 0.0 within 60 steps); 1e-4 reached 0.955 with both by step 40
        "actor.lr=1e-4",
    ],
}

DEFAULT_TASK = "arithmetic"  # the built-in model's task when data.task is unset


def presets_for(model_path: str, task: str | None, train_files: list) -> list[str]:
    """The preset overrides a run with these settings starts from (``[]`` for a user's model
    on its own data). ``task`` None with the built-in model means ``DEFAULT_TASK``."""
    out = list(MODEL_PRESETS.get(model_path, []))
    if model_path == "builtin" and task is None:
        task = DEFAULT_TASK
    if task is not None and not train_files:
        out += TASK_PRESETS.get(task, [])
    return out
