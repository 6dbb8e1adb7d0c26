"""The tests' default tiny decoder: ``otbrl.models.random_causal_lm`` at the tests' size."""

from __future__ import annotations

import torch

from otbrl.models import random_causal_lm

TEST_SIZE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def tiny_causal_lm(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """An fp32 causal LM small enough for 2 CPU cores: 2 layers, 4 heads, 2 KV heads, V = 64.

    ``overrides`` replace any config field (``vocab_size``, ``tie_word_embeddings``, ...); the
    weights depend only on ``seed`` and the config.
    """
    return random_causal_lm(arch, seed=seed, **{**TEST_SIZE, **overrides})
