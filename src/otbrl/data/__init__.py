"""otbrl.data: built-in tasks, parquet rows, prompt encoding, batch iteration."""

from otbrl.data.datasets import (
    PromptDataset,
    encode_prompts,
    read_parquet_rows,
    render_prompts,
    validate_row,
    write_parquet_rows,
)
from otbrl.data.tasks import ARITHMETIC_SOURCE, TASKS, ArithmeticTask, Task, get_task

__all__ = [
    "ARITHMETIC_SOURCE",
    "TASKS",
    "ArithmeticTask",
    "PromptDataset",
    "Task",
    "encode_prompts",
    "get_task",
    "read_parquet_rows",
    "render_prompts",
    "validate_row",
    "write_parquet_rows",
]
