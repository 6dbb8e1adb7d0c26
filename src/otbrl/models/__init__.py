"""otbrl.models: tiny task tokenizer and model, and loading of local HF model directories."""

from otbrl.models.hf import (
    ARCHS,
    DEFAULT_SIZE,
    build_tiny_model,
    eos_token_ids,
    load_model_and_tokenizer,
    load_value_model,
    random_causal_lm,
    resolve_model_dir,
)
from otbrl.models.tokenizer import (
    CHAT_TEMPLATE,
    RAW_PROMPT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
    set_prompt_template,
)

__all__ = [
    "ARCHS",
    "CHAT_TEMPLATE",
    "DEFAULT_SIZE",
    "RAW_PROMPT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "build_tokenizer",
    "eos_token_ids",
    "load_model_and_tokenizer",
    "load_value_model",
    "random_causal_lm",
    "resolve_model_dir",
    "set_prompt_template",
]
