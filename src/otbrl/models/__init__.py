"""otbrl.models: tiny task tokenizer and model, and loading of local HF model directories."""

from otbrl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "hf": (
            "ARCHS",
            "DEFAULT_SIZE",
            "build_tiny_model",
            "eos_token_ids",
            "load_model",
            "load_model_and_tokenizer",
            "load_tokenizer",
            "load_value_model",
            "random_causal_lm",
            "resolve_model_dir",
        ),
        "tokenizer": (
            "CHAT_TEMPLATE",
            "RAW_PROMPT_TEMPLATE",
            "SPECIAL_TOKENS",
            "build_tokenizer",
            "set_prompt_template",
        ),
    },
)
