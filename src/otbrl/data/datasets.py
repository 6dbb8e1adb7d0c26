"""Rows in the RL parquet schema: reading, writing, prompt encoding and a resumable batch iterator.

Schema of one row: ``prompt`` (list of ``{"role", "content"}`` chat messages), ``data_source``
(str, selects the built-in reward), ``reward_model.ground_truth`` (a str, a number, or a list
of them meaning "any of these"), optional ``extra_info`` (dict) and ``ability``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from otbrl.data.config import OVERLONG_PROMPTS
from otbrl.tools import tool_schemas, tools_for_row

REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")


def normalize_ground_truth(value, where: str = "ground_truth") -> str | list[str]:
    """A ground truth as the reward functions compare it: a str as is; a number as the text a
    person writes (``102.0`` -> ``"102"``, ``0.5`` -> ``"0.5"``), so it matches the answer
    ``102``; a list (any item counts as right) of those; verl's QA form ``{"target": answers}``
    as its answers. None, bools, NaN, other dicts, empty or nested lists are a ``ValueError``
    naming ``where``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and set(value) == {"target"}:  # Search-R1 rows
        return normalize_ground_truth(value["target"], where)
    if isinstance(value, list | tuple):
        if not value:
            raise ValueError(f"{where}: 'ground_truth' is an empty list (no right answer)")
        items = []
        for item in value:
            if isinstance(item, list | tuple):
                raise ValueError(f"{where}: 'ground_truth' lists must hold str or numbers")
            items.append(normalize_ground_truth(item, where))
        return items
    if isinstance(value, int | float | Decimal) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{where}: 'ground_truth' is {value}, expected a finite number")
        if isinstance(value, int) or value == int(value):
            return str(int(value))
        return repr(float(value)) if isinstance(value, float) else str(value.normalize())
    raise ValueError(
        f"{where}: 'ground_truth' must be a str, a number or a list of them, got "
        + ("null" if value is None else f"{type(value).__name__} {value!r}")
    )


def validate_row(row: dict, where: str = "row") -> dict:
    """Check one row against the schema; return it. ``where`` names it in the error."""
    if not isinstance(row, dict):
        raise TypeError(f"{where}: expected a dict, got {type(row).__name__}")
    prompt = row.get("prompt")
    if not isinstance(prompt, list | tuple) or not prompt:
        raise ValueError(
            f"{where}: 'prompt' must be a non-empty list of chat messages, got {prompt!r}"
        )
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"{where}: each prompt message needs 'role' and 'content', got {m!r}")
        # text, or a list of content parts (chat templates accept both); bytes mean the file
        # stored binary data where text belongs
        if not isinstance(m["content"], str | list):
            raise ValueError(
                f"{where}: prompt message 'content' must be text, got "
                f"{type(m['content']).__name__} (not UTF-8 text in the file?)"
            )
    if not isinstance(row.get("data_source"), str):
        raise ValueError(f"{where}: 'data_source' must be a str, got {row.get('data_source')!r}")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(
            f"{where}: 'reward_model' must be a dict with 'ground_truth', got {reward_model!r}"
        )
    normalize_ground_truth(reward_model["ground_truth"], where)
    return row


def read_parquet_rows(files: str | Path | Sequence[str | Path]) -> list[dict]:
    """Read and validate every row of one or more parquet files, in file order.

    Returns:
        A list of plain dicts; ``ground_truth`` goes through ``normalize_ground_truth``
        (numbers are common in the wild: ``102.0`` becomes ``"102"``) and a missing
        ``extra_info`` becomes ``{}``. Every problem with a file (missing, not parquet, not
        UTF-8, empty, a column missing, a bad row) is a one-line ``ValueError`` naming it.
    """
    paths = [files] if isinstance(files, str | Path) else list(files)
    if not paths:
        raise ValueError("files: expected at least one parquet file, got none")
    rows: list[dict] = []
    for path in paths:
        for i, row in enumerate(_read_table_rows(path)):
            validate_row(row, where=f"{path} row {i}")
            row["reward_model"] = {
                **row["reward_model"],
                "ground_truth": normalize_ground_truth(row["reward_model"]["ground_truth"]),
            }
            row["extra_info"] = row.get("extra_info") or {}
            rows.append(row)
    return rows


def _read_table_rows(path: str | Path) -> list[dict]:
    if not Path(path).is_file():
        raise ValueError(f"files: parquet file {str(path)!r} does not exist")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"files: {str(path)!r} is not a readable parquet file ({first})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(
            f"files: {str(path)!r} lacks the column(s) {missing} (it has {table.column_names})"
        )
    if table.num_rows == 0:
        raise ValueError(f"files: {str(path)!r} holds no rows")
    try:
        return table.to_pylist()
    except UnicodeDecodeError as err:
        raise ValueError(f"files: {str(path)!r} holds text that is not UTF-8 ({err})") from None


def write_parquet_rows(rows: Sequence[dict], path: str | Path) -> Path:
    """Write schema rows to a parquet file (temp name + rename, so never a torn file)."""
    if not rows:
        raise ValueError("rows: expected at least one row, got none")
    for i, row in enumerate(rows):
        validate_row(row, where=f"rows[{i}]")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
    tmp.replace(path)
    return path


def render_prompts(
    rows: Sequence[dict], tokenizer: PreTrainedTokenizerBase, tools: dict | None = None
) -> list[str]:
    """Chat-template text of each row's prompt, with the generation prompt appended.

    ``tools`` (``{name: otbrl.tools.Tool}``, multi-turn runs): each row's tools — its
    ``extra_info.tools`` / ``extra_info.tools_kwargs`` names, else all — reach the template as
    ``tools=[JSON schemas]`` (what chat templates that list tools expect).
    """
    if not tools:
        return [
            tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
            for row in rows
        ]
    return [
        tokenizer.apply_chat_template(
            row["prompt"],
            tools=tool_schemas(tools_for_row(row, tools), tools),
            add_generation_prompt=True,
            tokenize=False,
        )
        for row in rows
    ]


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads prompts and responses: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def tokenize_prompts(
    rows: Sequence[dict], tokenizer: PreTrainedTokenizerBase, tools: dict | None = None
) -> list[list[int]]:
    """[B] the token ids of each row's prompt (``render_prompts``; no padding)."""
    texts = render_prompts(rows, tokenizer, tools)
    # The template already holds the special tokens (BOS, role markers): add none twice.
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


OVERLONG = tuple(mode for mode in OVERLONG_PROMPTS if mode != "filter")  # what encoding does


def encode_prompts(
    rows: Sequence[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    tools: dict | None = None,
    *,
    overlong: str = "error",
) -> dict[str, Tensor]:
    """Tokenize prompts through the chat template (``tools`` as in ``render_prompts``),
    left-padded.

    Returns:
        ``input_ids`` [B, Lp] long and ``attention_mask`` [B, Lp] long, Lp = longest prompt.
        A prompt longer than ``max_prompt_length`` tokens is a ``ValueError`` naming its row
        (``overlong="error"``) or keeps its last ``max_prompt_length`` tokens
        (``"truncate_left"``: the end of the prompt, with the generation prompt, survives).
    """
    if not rows:
        raise ValueError("rows: expected at least one row, got none")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong: expected one of {OVERLONG}, got {overlong!r}")
    ids = tokenize_prompts(rows, tokenizer, tools)
    lengths = [len(x) for x in ids]
    worst = int(np.argmax(lengths))
    if lengths[worst] > max_prompt_length:
        if overlong == "error":
            raise ValueError(
                f"max_prompt_length: row {worst} (data_source "
                f"{rows[worst].get('data_source')!r}) has a {lengths[worst]}-token prompt, "
                f"longer than {max_prompt_length}"
            )
        ids = [x[-max_prompt_length:] for x in ids]
    pad_id = pad_token_id(tokenizer)
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        if x:
            input_ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
            attention_mask[i, width - len(x) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class PromptDataset:
    """Deterministic, resumable stream of prompt batches (lists of rows).

    Every epoch is a fresh permutation drawn from ``(seed, epoch)``; batches never straddle
    two epochs (a short tail is skipped), so ``batch_size`` rows come back every time.
    ``state_dict()`` is two ints; loading it resumes the exact same sequence. ``tools``: the
    multi-turn run's tools, which prompts are rendered with (``render_prompts``).
    """

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        max_prompt_length: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        tools: dict | None = None,
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int ≥ 1, got {batch_size!r}")
        if len(rows) < batch_size:
            raise ValueError(
                f"batch_size: {batch_size} is larger than the dataset ({len(rows)} rows)"
            )
        for i, row in enumerate(rows):
            validate_row(row, where=f"rows[{i}]")
        # the longest encoded prompt (tokens): a rollout engine sizes its context with it
        self.longest_prompt = 0
        if tokenizer is not None:
            # Fail at start-up, not at step 900, when one prompt is too long.
            for start in range(0, len(rows), 4096):
                enc = encode_prompts(
                    rows[start : start + 4096], tokenizer, max_prompt_length, tools
                )
                longest = int(enc["attention_mask"].sum(dim=1).max())
                self.longest_prompt = max(self.longest_prompt, longest)
        self.rows = list(rows)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.rows) // self.batch_size

    def next_batch(self) -> list[dict]:
        """The next ``batch_size`` rows."""
        if self.position + self.batch_size > len(self.rows):
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        idx = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.rows[i] for i in idx]

    def state_dict(self) -> dict[str, int]:
        """The data position: ``{"epoch", "position"}``."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a position saved by ``state_dict``."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.rows):
            raise ValueError(
                f"state: expected epoch ≥ 0 and 0 ≤ position ≤ {len(self.rows)}, got {state!r}"
            )
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
