"""The tests' tiny models: ``otbrl.models.random_causal_lm`` at the tests' size, the sizes the
tests give ``build_tiny_model``, and the tiny models some tests train or sharpen first."""

from __future__ import annotations

from pathlib import Path

import torch

from otbrl.models import random_causal_lm

# ``build_tiny_model`` sizes (its vocabulary is the task's alphabet; 4 heads and 4 KV heads
# unless named): seconds-long runs on 2 CPU cores
ONE_LAYER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
TWO_LAYERS = {**ONE_LAYER, "num_hidden_layers": 2}
# vLLM's CPU attention needs a head size it has kernels for: 32 (hidden 64, 2 heads)
VLLM_SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1)
VLLM_SIZE.update(num_attention_heads=2, num_key_value_heads=2)

TEST_SIZE = dict(
    vocab_size=64,
    **TWO_LAYERS,
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


def sharpened_policy(root: Path, arch: str, *, scale: float, eos_boost: float, prompts: int):
    """A ``TWO_LAYERS`` ``arch`` model under ``root`` whose near-uniform random-init logits are
    spread (``lm_head`` x ``scale``, the EOS row raised by ``eos_boost`` x the mean row) so that
    EOS shows up and greedy has no near-ties, and ``prompts`` arithmetic prompts (the first a
    shorter one), left-padded: ``(model, tokenizer, input_ids, attention_mask)``."""
    from otbrl.data import encode_prompts, get_task
    from otbrl.models import build_tiny_model, load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(build_tiny_model(root, arch=arch, **TWO_LAYERS))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        model.lm_head.weight[tok.eos_token_id] += eos_boost * model.lm_head.weight.mean(0)
    rows = get_task("arithmetic").rows("val", prompts, seed=0)
    rows[0] = {**rows[0], "prompt": [{"role": "user", "content": "1+2="}]}  # a shorter prompt
    enc = encode_prompts(rows, tok, max_prompt_length=16)
    return model, tok, enc["input_ids"], enc["attention_mask"]


def taught_tool_model(path: Path, task, *, rows: int, steps: int, **size):
    """A tiny ``tool_arithmetic`` model (``build_tiny_model`` at ``size``) taught the calculator
    call format by a short SFT (lr 3e-3, batches of 64, ``steps`` steps) on the demonstrations
    of ``rows`` of ``task``'s training rows; the taught weights are saved back to ``path`` (vLLM
    and the trainer read them there). Returns ``(model, tokenizer)``, the model in eval mode."""
    from otbrl.config import SFTConfig
    from otbrl.models import build_tiny_model, load_model_and_tokenizer
    from otbrl.run.sft import run_sft
    from otbrl.tools import resolve_tools

    path = build_tiny_model(path, task="tool_arithmetic", seed=0, **size)
    model, tok = load_model_and_tokenizer(path)
    train = task.rows("train", rows, seed=0)
    with torch.random.fork_rng(devices=[]):
        run_sft(
            model, tok, train, [task.demonstration(r) for r in train],
            SFTConfig(lr=3e-3, batch_size=64, max_steps=steps, warmup_steps=0, grad_clip=0.0),
            seed=0, tools=resolve_tools(["calculator"]),
        )  # fmt: skip
    model.eval()
    model.save_pretrained(path)
    return model, tok


def steer_to_calls(model, tokenizer):
    """A random model seldom writes a call: raise the logits of ``<tool_call>`` and
    ``</tool_call>`` in every forward (sampling and the trainer's alike), so samples hold calls
    (error observations mostly: the bodies are random), holes and later turns."""
    bias = torch.zeros(model.config.vocab_size)
    bias[tokenizer.convert_tokens_to_ids("<tool_call>")] = 3.0
    bias[tokenizer.convert_tokens_to_ids("</tool_call>")] = 2.5
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
