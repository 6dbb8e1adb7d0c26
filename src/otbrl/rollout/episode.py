"""One sample of the agent loop: the trajectory it hands the batch (``Trajectory``) and the
stream under construction (``Episode``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from otbrl.rollout.protocol import Completion


@dataclass
class Trajectory(Completion):
    """A multi-turn completion: ``token_ids`` / ``logprobs`` hold model and observation tokens
    in one stream (log-prob 0 on observations); ``mask[t]`` is 1 on model tokens, 0 on
    observation tokens. ``num_turns``: model turns; ``tool_calls``: calls answered (errors
    included); ``tool_errors``: calls whose observation is an error. ``rewards``: the
    environment's step rewards, each at ``reward_positions`` (the index in ``token_ids`` of
    the last token of the turn it scored). ``env_error``: why the environment failed this
    sample (None: it did not). ``retokenized``: whether the template's rendering of the final
    conversation, tokenized again, differs from the stream (``env/retokenization_mismatch``)."""

    mask: list[int] = field(default_factory=list)
    num_turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    rewards: list[float] = field(default_factory=list)
    reward_positions: list[int] = field(default_factory=list)
    env_error: str | None = None
    retokenized: bool = False


class Episode:
    """One sample's stream under construction and its environment (``env``), its turns' ids and
    observation messages (for the re-rendering check) and the steps' rewards."""

    def __init__(self, prompt: list[int], budget: int, data: Mapping):
        self.prompt, self.budget, self.data = prompt, budget, data
        self.env = None
        self.opening: list[dict] = []  # reset's observation
        self.history: list[list[dict]] = []  # each step's observation messages
        self.turns: list[list[int]] = []  # each model turn's ids
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.rewards: list[float] = []
        self.reward_positions: list[int] = []
        self.num_turns = self.tool_calls = self.tool_errors = 0
        self.finish_reason = "stop"
        self.env_error: str | None = None
        self.retokenized = False
        self.last: Completion | None = None
        self.version: int | None = None  # the oldest turn's weight version
        # per token (partial rollouts): model tokens their own, observations their turn's newest
        self.versions: list[int] | None = []

    def room(self) -> int:
        return self.budget - len(self.tokens)

    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def fail(self, why: str) -> None:
        self.env_error = why
        self.finish_reason = "stop" if self.last is None else self.last.finish_reason

    def add_model(self, completion: Completion) -> None:
        self.tokens += completion.token_ids
        self.logprobs += completion.logprobs
        self.mask += [1] * len(completion.token_ids)
        self.turns.append(list(completion.token_ids))
        self.num_turns += 1
        self.last = completion
        if completion.version is not None:
            old = self.version
            self.version = completion.version if old is None else min(old, completion.version)
        if completion.token_versions is None or self.versions is None:
            self.versions = None
        else:
            self.versions += completion.token_versions

    def add_observation(self, ids: list[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        if self.versions is not None:
            newest = self.versions[-1] if self.versions else (self.version or 0)
            self.versions += [newest] * len(ids)

    def trajectory(self) -> Trajectory:
        return Trajectory(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            version=self.version,
            token_versions=self.versions,
            mask=self.mask,
            num_turns=self.num_turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            rewards=self.rewards,
            reward_positions=self.reward_positions,
            env_error=self.env_error,
            retokenized=self.retokenized,
        )
