"""Built-in synthetic tasks: rows in the parquet schema, plus the demonstrations SFT learns from.

A row is ``{"prompt": [{"role": "user", "content": "12+34="}], "data_source": "otbrl/arithmetic",
"ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": "46"},
"extra_info": {"split": "train", "index": 0}}`` — the widely used RL-parquet schema, so a built-in
task and a user's parquet file flow through the same code.
"""

from __future__ import annotations

import numpy as np

from otbrl.tools.calculator import calculator

ARITHMETIC_SOURCE = "otbrl/arithmetic"
DIGIT_SUM_SOURCE = "otbrl/digit_sum"
TOOL_ARITHMETIC_SOURCE = "otbrl/tool_arithmetic"
CHAIN_SUM_SOURCE = "otbrl/chain_sum"
GUESS_SOURCE = "otbrl/guess"
SPLITS = ("train", "val")


class Task:
    """A built-in task. Subclasses set the attributes, fill ``_pools`` and implement
    ``_row``/``demonstration``.

    Attributes:
        name: registry name (``get_task(name)``).
        data_source: the ``data_source`` of every row; selects the built-in reward.
        alphabet: every character a prompt or response can contain (sizes the tiny tokenizer).
        max_response_chars: longest demonstration, in characters (= tokens for the tiny
            tokenizer, before EOS; observation tokens included for a tool task).
        tools: built-in tools the task's demonstrations call (its tokenizer then has the
            tool-call tokens); empty for single-turn tasks.
        env: the built-in environment its episodes run in (``otbrl.envs.builtin``); None:
            none.
        max_turns: model turns of a multi-turn episode (its warm start's greedy evaluation).
        model_size: the built-in model's sizes this task needs beyond ``DEFAULT_SIZE``
            (``otbrl.models.hf``), e.g. more positions for long responses.
    """

    name: str
    data_source: str
    alphabet: str
    max_response_chars: int
    tools: tuple[str, ...] = ()
    env: str | None = None
    max_turns: int = 4
    model_size: dict = {}  # noqa: RUF012 (read only)
    _pools: dict[str, np.ndarray]  # per split, one item per row; ``_row`` turns it into a row

    def split_size(self, split: str) -> int:
        """Number of rows in ``split``."""
        return len(self._split(split))

    def rows(self, split: str, n: int | None = None, seed: int = 0) -> list[dict]:
        """``n`` rows of ``split`` (all of it when ``None``), in an order fixed by ``seed``."""
        pool = self._split(split)
        n = len(pool) if n is None else n
        if not isinstance(n, int) or not 0 < n <= len(pool):
            raise ValueError(
                f"n: expected an int in [1, {len(pool)}] for split {split!r}, got {n!r}"
            )
        order = np.random.default_rng(seed).permutation(len(pool))[:n]
        return [self._row(split, int(i), pool[i]) for i in order]

    def demonstration(self, row: dict) -> str | list[dict]:
        """What SFT teaches for ``row``: the response text (without EOS), or for a tool task
        possibly a list of turns — assistant messages (``content`` or ``tool_calls``) and the
        tool messages answering them (``otbrl.tools.ChatTurns.conversation_ids`` encodes
        them the way the agent loop would)."""
        raise NotImplementedError

    def _split(self, split: str) -> np.ndarray:
        if split not in self._pools:
            raise ValueError(f"split: expected one of {list(self._pools)}, got {split!r}")
        return self._pools[split]

    def _row(self, split: str, index: int, item) -> dict:
        """The schema row for item ``index`` of ``split`` (``item`` = its pool entry)."""
        raise NotImplementedError


def _check_split_sizes(**sizes) -> None:
    """``ValueError`` naming the first of ``sizes`` (rows per split) that is not an int >= 1."""
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


class ArithmeticTask(Task):
    """``a+b=`` with ``digits``-digit operands; the answer is the decimal sum.

    Every operand pair occurs once; a fixed permutation (``split_seed``) assigns the first
    ``n_val`` pairs to ``val`` and the rest to ``train``, so the splits are disjoint whatever
    ``seed`` a caller draws rows with.
    """

    name = "arithmetic"
    data_source = ARITHMETIC_SOURCE
    alphabet = "0123456789+="

    def __init__(self, digits: int = 2, n_val: int = 1000, split_seed: int = 1234):
        if not isinstance(digits, int) or not 1 <= digits <= 4:
            raise ValueError(f"digits: expected an int in [1, 4], got {digits!r}")
        low, high = (10 ** (digits - 1) if digits > 1 else 0), 10**digits
        n_pairs = (high - low) ** 2
        if not isinstance(n_val, int) or not 0 < n_val < n_pairs:
            raise ValueError(f"n_val: expected an int in (0, {n_pairs}), got {n_val!r}")
        self.digits = digits
        self.max_response_chars = digits + 1
        a, b = np.meshgrid(np.arange(low, high), np.arange(low, high), indexing="ij")
        pairs = np.stack([a.ravel(), b.ravel()], axis=1)
        pairs = pairs[np.random.default_rng(split_seed).permutation(n_pairs)]
        self._pools = {"val": pairs[:n_val], "train": pairs[n_val:]}

    def demonstration(self, row: dict) -> str:
        return str(row["reward_model"]["ground_truth"])

    def _row(self, split: str, index: int, pair: np.ndarray) -> dict:
        a, b = int(pair[0]), int(pair[1])
        return {
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "data_source": self.data_source,
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index},
        }


class DigitSumTask(Task):
    """``S:`` -> any string of digits 1-9 whose digits sum to S (at most ``max_digits`` of them).

    Many answers of different lengths are right (S = 12: ``39``, ``66``, ``111117``...), so the
    response length varies *within* a group of samples for one prompt: the task the tail rule
    and length-dependent baselines of OTB matter on (the arithmetic task has one answer per
    prompt, so every sample of a group has the same length). Demonstrations draw the length
    uniformly from the feasible range ``ceil(S/9) .. min(S, max_digits)`` and then a uniform
    composition, fixed per row. Only ``max_sum`` prompt texts exist, so ``val`` rows repeat the
    prompts of ``train`` (with their own draws): the task measures how reliably the policy
    samples a valid answer, not generalization to unseen prompts.
    """

    name = "digit_sum"
    data_source = DIGIT_SUM_SOURCE
    alphabet = "0123456789:"

    def __init__(
        self,
        max_sum: int = 40,
        max_digits: int = 8,
        n_train: int = 20000,
        n_val: int = 1000,
        split_seed: int = 1234,
    ):
        if not isinstance(max_digits, int) or not 1 <= max_digits <= 16:
            raise ValueError(f"max_digits: expected an int in [1, 16], got {max_digits!r}")
        if not isinstance(max_sum, int) or not 1 <= max_sum <= 9 * max_digits:
            raise ValueError(
                f"max_sum: expected an int in [1, 9 * max_digits = {9 * max_digits}], "
                f"got {max_sum!r}"
            )
        _check_split_sizes(n_train=n_train, n_val=n_val)
        self.max_sum, self.max_digits, self.split_seed = max_sum, max_digits, split_seed
        self.max_response_chars = max_digits
        rng = np.random.default_rng(split_seed)
        self._pools = {
            "train": rng.integers(1, max_sum + 1, size=n_train),
            "val": rng.integers(1, max_sum + 1, size=n_val),
        }

    def demonstration(self, row: dict) -> str:
        total = int(row["reward_model"]["ground_truth"])
        split_id = SPLITS.index(row["extra_info"]["split"])
        rng = np.random.default_rng([self.split_seed, split_id, row["extra_info"]["index"]])
        length = int(rng.integers(-(-total // 9), min(total, self.max_digits) + 1))
        digits = np.ones(length, dtype=np.int64)
        for _ in range(total - length):  # one unit at a time into a digit that is not yet 9
            open_slots = np.flatnonzero(digits < 9)
            digits[open_slots[rng.integers(len(open_slots))]] += 1
        return "".join(map(str, digits))

    def _row(self, split: str, index: int, total: np.int64) -> dict:
        total = int(total)
        return {
            "prompt": [{"role": "user", "content": f"{total}:"}],
            "data_source": self.data_source,
            "ability": "digit_sum",
            "reward_model": {"style": "rule", "ground_truth": str(total)},
            "extra_info": {"split": split, "index": index},
        }


class ToolArithmeticTask(Task):
    """``a*b=`` with a 4-digit ``a`` and a 2-digit ``b``: the product, which the tiny model cannot
    compute alone but can read off the built-in ``calculator``.

    ``n_train + n_val`` distinct pairs are drawn once (``split_seed``) and split. Demonstrations
    mix the two ways to answer, fixed per row: a call ``<tool_call>a*b</tool_call>``, the
    calculator's result as the observation, then the answer; or the answer directly. Rows whose
    ``a`` starts with one of ``tool_leading_digits`` always call; the others call with
    probability ``tool_fraction``. The split is one the model can read off the prompt, so the
    warm-started *greedy* policy calls on those prompts only (a per-row coin alone would not do:
    the call token, one choice, outweighs any one first digit of a direct answer, and greedy
    decoding would always call), while the sampled policy still tries the tool elsewhere. RL
    from the exact-match reward alone then has to spread the tool to the other prompts.
    """

    name = "tool_arithmetic"
    data_source = TOOL_ARITHMETIC_SOURCE
    # every printable ASCII character: tool error messages survive the character tokenizer
    alphabet = "".join(map(chr, range(32, 127)))
    tools = ("calculator",)
    # call (<tool_call> 7 </tool_call>) + observation (<tool_response> 6 </tool_response>
    # <assistant>) + 6 answer digits, in tokens of the built-in tokenizer
    max_response_chars = 24

    def __init__(
        self,
        n_train: int = 20000,
        n_val: int = 1000,
        tool_leading_digits: str = "123",
        tool_fraction: float = 0.2,
        split_seed: int = 1234,
    ):
        _check_split_sizes(n_train=n_train, n_val=n_val)
        if not isinstance(tool_leading_digits, str) or not set(tool_leading_digits) <= set(
            "123456789"
        ):
            raise ValueError(
                f"tool_leading_digits: expected a string of digits 1-9, got {tool_leading_digits!r}"
            )
        if not 0.0 <= tool_fraction <= 1.0:
            raise ValueError(f"tool_fraction: expected a number in [0, 1], got {tool_fraction!r}")
        self.tool_leading_digits = tool_leading_digits
        self.tool_fraction, self.split_seed = tool_fraction, split_seed
        rng = np.random.default_rng(split_seed)
        codes = rng.choice(9000 * 90, size=n_train + n_val, replace=False)
        pairs = np.stack([1000 + codes // 90, 10 + codes % 90], axis=1)
        self._pools = {"val": pairs[:n_val], "train": pairs[n_val:]}

    def uses_tool(self, row: dict) -> bool:
        """Whether the demonstration of ``row`` calls the calculator (fixed per row)."""
        if row["extra_info"]["expression"][0] in self.tool_leading_digits:
            return True
        split_id = SPLITS.index(row["extra_info"]["split"])
        rng = np.random.default_rng([self.split_seed, 7, split_id, row["extra_info"]["index"]])
        return bool(rng.random() < self.tool_fraction)

    def demonstration(self, row: dict) -> str | list[dict]:
        answer = str(row["reward_model"]["ground_truth"])
        if not self.uses_tool(row):
            return answer
        expression = row["extra_info"]["expression"]
        return [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "calculator", "arguments": {"expression": expression}}],
            },
            {"role": "tool", "name": "calculator", "content": calculator(expression)},
            {"role": "assistant", "content": answer},
        ]

    def _row(self, split: str, index: int, pair: np.ndarray) -> dict:
        a, b = int(pair[0]), int(pair[1])
        return {
            "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "data_source": self.data_source,
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": index, "expression": f"{a}*{b}"},
        }


class ChainSumTask(Task):
    """A long-response task: the sum modulo 10 of 10-26 labelled digits, step by step.

    The prompt lists the items, ``a3b7c5d2e8=``; the response walks through them, writing the
    running total (modulo 10) after each item or, at times, after two
    (``a3=3;b7c5=5;d2=7;e8=5;``), and ends with the answer after GSM8K's marker, ``####5``.
    The reward (``otbrl.rewards.builtin.chain_sum``) checks every step — each item in order,
    each total right — and the answer: one slip anywhere and the sample scores 0, the
    long-response credit-assignment problem OTB's per-token baseline is about. (A reward on
    the answer alone would pay for chains whose slips cancel, and RL then learns slips: tried
    on a two-digit variant, it did.) Responses run to 46-135 tokens; their length varies with
    the number of items (per prompt) and, within a group, with how many totals a sample skips.
    The labels make each step's lookup of its digit in the prompt a match on content, and each
    step's arithmetic is a one-digit addition modulo 10 next to the digits it needs: the tiny
    model learns a step well, and a chain of them only as well as every step.

    Demonstrations skip a total with probability ``skip_prob`` (never twice in a row, never
    after the last item), drawn per row and fixed. Items are uniform digits 0-9; the number of
    items is uniform in ``[min_items, max_items]``; ``n_train``/``n_val`` rows are drawn once
    from ``split_seed`` (train and val from separate streams: a shared prompt is unlikely at
    these lengths, and the tests check there is none).
    """

    name = "chain_sum"
    data_source = CHAIN_SUM_SOURCE
    labels = "abcdefghijklmnopqrstuvwxyz"
    alphabet = labels + "0123456789=;#"
    # prompt (at most 26 pairs + "=" + 3 template tokens) + the longest response + EOS = 192
    model_size = {"max_position_embeddings": 256}  # noqa: RUF012 (read only)

    def __init__(
        self,
        min_items: int = 10,
        max_items: int = 26,
        skip_prob: float = 0.3,
        n_train: int = 50000,
        n_val: int = 1000,
        split_seed: int = 1234,
    ):
        if not isinstance(max_items, int) or not 2 <= max_items <= len(self.labels):
            raise ValueError(
                f"max_items: expected an int in [2, {len(self.labels)}], got {max_items!r}"
            )
        if not isinstance(min_items, int) or not 1 <= min_items <= max_items:
            raise ValueError(
                f"min_items: expected an int in [1, max_items={max_items}], got {min_items!r}"
            )
        if not 0.0 <= skip_prob <= 1.0:
            raise ValueError(f"skip_prob: expected a number in [0, 1], got {skip_prob!r}")
        _check_split_sizes(n_train=n_train, n_val=n_val)
        self.min_items, self.max_items = min_items, max_items
        self.skip_prob, self.split_seed = skip_prob, split_seed
        # every item written with its total ("c5=5;"), then "####" and the answer
        self.max_response_chars = 5 * max_items + 5
        self._pools = {}
        for split_id, (split, size) in enumerate((("train", n_train), ("val", n_val))):
            rng = np.random.default_rng([split_seed, split_id])
            counts = rng.integers(min_items, max_items + 1, size=size)
            digits = rng.integers(0, 10, size=(size, max_items))
            digits[np.arange(max_items) >= counts[:, None]] = -1  # -1: no item
            self._pools[split] = digits

    def demonstration(self, row: dict) -> str:
        digits = [int(d) for d in row["extra_info"]["items"][1::2]]
        split_id = SPLITS.index(row["extra_info"]["split"])
        rng = np.random.default_rng([self.split_seed, 11, split_id, row["extra_info"]["index"]])
        skips = rng.random(len(digits)) < self.skip_prob
        out, total, skipped = [], 0, False
        for i, digit in enumerate(digits):
            total = (total + digit) % 10
            out.append(f"{self.labels[i]}{digit}")
            if skips[i] and not skipped and i < len(digits) - 1:
                skipped = True
            else:
                out.append(f"={total};")
                skipped = False
        return "".join(out) + f"####{total}"

    def _row(self, split: str, index: int, digits: np.ndarray) -> dict:
        digits = [int(d) for d in digits if d >= 0]
        items = "".join(f"{self.labels[i]}{d}" for i, d in enumerate(digits))
        return {
            "prompt": [{"role": "user", "content": f"{items}="}],
            "data_source": self.data_source,
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(sum(digits) % 10)},
            "extra_info": {"split": split, "index": index, "items": items},
        }


class GuessTask(Task):
    """Find a secret number in ``1..high`` by guessing: the prompt is ``?``, each model turn is
    a guess, and the built-in ``guess`` environment answers ``+`` (the secret is higher) or
    ``-`` (lower) until the guess is right (reward 1) or the turns run out (0). The reward needs
    the observations: no single answer fits every row, only a search that reads the feedback.

    Demonstrations guess uniformly at random inside the interval the feedback so far leaves
    (fixed per row), for at most ``max_turns`` guesses: always consistent, but not halving, so
    they often need more turns than the episode allows (0.61 of them find the secret with the
    defaults) — bisection (``high = 2**k - 1`` finds any secret in k turns) is what
    RL can learn on top. Train and val rows draw their secrets from one generator each
    (``split_seed``): only ``high`` secrets exist, so the task measures the search, not
    generalization to unseen prompts.
    """

    name = "guess"
    data_source = GUESS_SOURCE
    alphabet = "0123456789?+-"
    env = "guess"

    def __init__(
        self,
        high: int = 15,
        max_turns: int = 4,
        n_train: int = 20000,
        n_val: int = 1000,
        split_seed: int = 1234,
    ):
        _check_split_sizes(n_train=n_train, n_val=n_val)
        if not isinstance(high, int) or not 2 <= high <= 999:
            raise ValueError(f"high: expected an int in [2, 999], got {high!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns: expected an int >= 1, got {max_turns!r}")
        self.high, self.split_seed, self.max_turns = high, split_seed, max_turns
        # max_turns guesses (digits + EOS) and the answers between them (<user> sign
        # <assistant>), the last guess's EOS left out (the budget check adds it)
        self.max_response_chars = max_turns * (len(str(high)) + 1) + (max_turns - 1) * 3 - 1
        rng = np.random.default_rng(split_seed)
        secrets = rng.integers(1, high + 1, size=n_train + n_val)
        self._pools = {"val": secrets[:n_val], "train": secrets[n_val:]}

    def demonstration(self, row: dict) -> list[dict]:
        secret = int(row["reward_model"]["ground_truth"])
        split_id = SPLITS.index(row["extra_info"]["split"])
        rng = np.random.default_rng([self.split_seed, 11, split_id, row["extra_info"]["index"]])
        low, high, turns = 1, self.high, []
        while True:
            guess = int(rng.integers(low, high + 1))
            turns.append({"role": "assistant", "content": str(guess)})
            if guess == secret or len(turns) == 2 * self.max_turns - 1:
                return turns  # found, or out of turns (as the agent loop ends the episode)
            turns.append({"role": "user", "content": "+" if secret > guess else "-"})
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)

    def _row(self, split: str, index: int, secret) -> dict:
        return {
            "prompt": [{"role": "user", "content": "?"}],
            "data_source": self.data_source,
            "ability": "search",
            "reward_model": {"style": "rule", "ground_truth": str(int(secret))},
            "extra_info": {"split": split, "index": index, "high": self.high},
        }


TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "digit_sum": DigitSumTask,
    "tool_arithmetic": ToolArithmeticTask,
    "chain_sum": ChainSumTask,
    "guess": GuessTask,
}


def get_task(name: str, **kwargs) -> Task:
    """The built-in task called ``name`` (``kwargs`` go to its constructor)."""
    if name not in TASKS:
        raise ValueError(f"task: expected one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name](**kwargs)
