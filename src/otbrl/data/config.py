"""The data's settings (``data.*``): which rows, how many per step, how long a prompt may be.
No torch or pandas: the CLI's schema composes ``DataConfig`` and starts without them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from otbrl.settings import refuse_unset, setting

# data.overlong_prompts; "filter" drops the rows before they are encoded (the run's plan)
OVERLONG_PROMPTS = ("error", "filter", "truncate_left")


@dataclass
class DataConfig:
    # parquet (verl's row schema)
    train_files: list[str] = setting(default_factory=list, resume="fixed")
    # parquet validation rows (same schema); empty: none, or the task's
    val_files: list[str] = setting(default_factory=list, resume="fixed")
    # a built-in task ("arithmetic" | "digit_sum" | "tool_arithmetic" | "chain_sum" |
    # "guess") or a reasoning-gym dataset ("reasoning_gym:NAME", a composite
    # "reasoning_gym:NAME=WEIGHT,NAME=WEIGHT") as the data when no files are given (a built-in
    # brings its preset, otbrl.config.presets); None: the built-in model's "arithmetic", and
    # for a user's model no fallback (data.train_files is required)
    task: str | None = setting(None, resume="fixed")
    # a reasoning-gym task's dataset options, its config fields (a composite: one mapping
    # per dataset name), e.g. data.task_options.min_animals=2
    task_options: dict[str, Any] = setting(default_factory=dict, resume="fixed")
    # a reasoning-gym task's training entries; None: 10000
    train_size: int | None = setting(None, ge=1, null="10000 entries", resume="fixed")
    train_batch_size: int = setting(32, gt=0, resume="fixed")  # prompts per RL step
    # validation prompts: a seeded sample of this many rows of data.val_files; None: all of
    # them (the built-in task: 500)
    val_size: int | None = setting(None, ge=1, null="all validation rows", resume="fixed")
    max_prompt_length: int = setting(512, gt=0, resume="fixed")  # tokens, chat template included
    # tokens per response (multi-turn: observations included)
    max_response_length: int = setting(512, gt=0, resume="fixed")
    # a prompt longer than max_prompt_length: "error" (at start, naming the row) | "filter"
    # (dropped, counted, reported) | "truncate_left" (its first tokens cut)
    overlong_prompts: str = setting("error", choices=OVERLONG_PROMPTS, resume="fixed")
    # render prompts with the tokenizer's chat template; false: the messages' text as written
    # (base models without a template)
    apply_chat_template: bool = setting(True, resume="fixed")
    # seeds the shuffling of the training rows and the validation sample
    seed: int = setting(0, resume="fixed")

    def check(self, at: str) -> None:
        """A reasoning-gym task's keys only with one."""
        if not (self.task or "").startswith("reasoning_gym:"):
            because = f"'{at}task' is not a reasoning-gym dataset"
            fix = f"set {at}task=reasoning_gym:NAME"
            refuse_unset(self, at, because, fix, ["task_options", "train_size"])
