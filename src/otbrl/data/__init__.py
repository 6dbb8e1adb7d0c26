"""otbrl.data: built-in tasks, parquet rows, prompt encoding, batch iteration."""

from otbrl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "datasets": (
            "PromptDataset",
            "encode_prompts",
            "normalize_ground_truth",
            "pad_token_id",
            "read_parquet_rows",
            "render_prompts",
            "tokenize_prompts",
            "validate_row",
            "write_parquet_rows",
        ),
        "tasks": (
            "ARITHMETIC_SOURCE",
            "CHAIN_SUM_SOURCE",
            "DIGIT_SUM_SOURCE",
            "TASKS",
            "ArithmeticTask",
            "ChainSumTask",
            "DigitSumTask",
            "Task",
            "get_task",
        ),
    },
)
