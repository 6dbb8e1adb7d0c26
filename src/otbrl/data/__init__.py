"""otbrl.data: built-in tasks, parquet rows, prompt encoding, batch iteration."""

from otbrl.data.datasets import (
    PromptDataset,
    encode_prompts,
    normalize_ground_truth,
    pad_token_id,
    read_parquet_rows,
    render_prompts,
    tokenize_prompts,
    validate_row,
    write_parquet_rows,
)
from otbrl.data.tasks import (
    ARITHMETIC_SOURCE,
    DIGIT_SUM_SOURCE,
    TASKS,
    ArithmeticTask,
    DigitSumTask,
    Task,
    get_task,
)

__all__ = [
    "ARITHMETIC_SOURCE",
    "DIGIT_SUM_SOURCE",
    "TASKS",
    "ArithmeticTask",
    "DigitSumTask",
    "PromptDataset",
    "Task",
    "encode_prompts",
    "get_task",
    "normalize_ground_truth",
    "pad_token_id",
    "read_parquet_rows",
    "render_prompts",
    "tokenize_prompts",
    "validate_row",
    "write_parquet_rows",
]
