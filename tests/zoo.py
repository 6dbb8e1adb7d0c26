"""Stand-ins for the models users start with: tiny random models built from the real configs.

Each entry keeps every config feature of its family that changes a code path in otbrl, vLLM or
transformers — tied embeddings, q/k/v bias, the grouped-query ratio's shape (few KV heads),
rope type and scaling, a head_dim that is not hidden/heads, q/k norms, scaled embeddings, a
tokenizer without a pad token — and shrinks the rest (2 layers, a 400-token byte-level BPE),
so a step takes a fraction of a second. Every head_dim is ≥ 32 (vLLM's CPU attention) and
head counts divide by 2 where the family allows 2-way tensor parallelism.

- ``qwen2.5`` (Qwen2.5-0.5B/1.5B/3B-Instruct): Qwen2, tied, q/k/v bias, 8:2 heads, rope θ 1e6,
  ChatML with a tools section, pad ``<|endoftext|>``.
- ``llama3.2`` (Llama-3.2-1B/3B-Instruct): Llama, tied, ``rope_type=llama3`` scaling (factor 32
  over 128 original positions), head_dim 64, header chat template, BOS, **no pad token**.
- ``qwen3`` (Qwen3-0.6B…8B): Qwen3, tied, q/k RMSNorm, head_dim 64 ≠ hidden/heads (128/4).
- ``mistral`` (Mistral-7B-Instruct-v0.3, the untied Llama style): **untied**, 8:2 heads,
  ``[INST]`` template, BOS, no pad token.
- ``gemma`` (Gemma-2B): tied, embeddings scaled by √hidden, GeGLU, **one KV head** (MQA: no
  2-way tensor parallelism), head_dim 32 ≠ hidden/heads (64/4).

Models are saved with ``save_pretrained`` and loaded back through the HF Auto classes, the
tokenizer with ``tokenizer_class`` ``PreTrainedTokenizerFast`` (what Llama-3's repository
declares): a byte-level BPE round-trips text exactly (``decode(encode(t)) == t``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from user_model import TOOLS_CHATML, byte_level_tokenizer

CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}\n\n{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# name -> (model_type, config fields, tokenizer: specials, eos, pad, bos, chat template)
ZOO: dict[str, dict] = {
    "qwen2.5": {
        "model_type": "qwen2",
        "config": dict(
            hidden_size=256, intermediate_size=512, num_attention_heads=8,
            num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1_000_000.0,
            use_sliding_window=False,
        ),
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "eos": "<|im_end|>", "pad": "<|endoftext|>", "bos": None, "template": TOOLS_CHATML,
    },
    "llama3.2": {
        "model_type": "llama",
        "config": dict(
            hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500_000.0,
            rope_scaling={
                "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
            },
        ),
        "specials": [
            "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>",
        ],
        "eos": "<|eot_id|>", "pad": None, "bos": "<|begin_of_text|>", "template": LLAMA3,
    },
    "qwen3": {
        "model_type": "qwen3",
        "config": dict(
            hidden_size=128, intermediate_size=384, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
            rope_theta=1_000_000.0,
        ),
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "eos": "<|im_end|>", "pad": "<|endoftext|>", "bos": None, "template": CHATML,
    },
    "mistral": {
        "model_type": "mistral",
        "config": dict(
            hidden_size=256, intermediate_size=512, num_attention_heads=8,
            num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None,
            rope_theta=1_000_000.0,
        ),
        "specials": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "eos": "</s>", "pad": None, "bos": "<s>", "template": MISTRAL,
    },
    "gemma": {
        "model_type": "gemma",
        "config": dict(
            hidden_size=64, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh",
        ),
        "specials": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        "eos": "<end_of_turn>", "pad": "<pad>", "bos": "<bos>", "template": GEMMA,
    },
}  # fmt: skip
ZOO_NAMES = tuple(ZOO)
# the headline stand-in: what the commands run on
QWEN = "qwen2.5"


def build_standin(name: str, out_dir: str | Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Write the stand-in ``name`` (one of :data:`ZOO_NAMES`) to ``out_dir``: ``config.json``,
    ``model.safetensors`` (``save_pretrained``), the tokenizer and its chat template. The
    weights depend only on ``name`` and ``seed``. Returns ``Path(out_dir)``."""
    if name not in ZOO:
        raise ValueError(f"name: expected one of {ZOO_NAMES}, got {name!r}")
    spec = ZOO[name]
    tok = byte_level_tokenizer(
        spec["specials"], eos=spec["eos"], pad=spec["pad"], bos=spec["bos"],
        chat_template=spec["template"],
    )  # fmt: skip
    config = AutoConfig.for_model(
        spec["model_type"],
        vocab_size=len(tok),
        num_hidden_layers=layers,
        max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        **spec["config"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # random init samples near-uniformly over the 400 tokens: responses differ in text and
        # length, so a length-parity reward varies inside every group. (Scaling a tied
        # embedding up makes the model repeat its last prompt token: logits = E·h.)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # declare the class, as Llama-3's repository does: AutoTokenizer would otherwise pick the
    # model type's class (Qwen2Tokenizer, LlamaTokenizer…), which rebuilds its own pre-tokenizer
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2))
    return out


def head_dim(model_dir: str | Path) -> int:
    """The attention head size declared by (or implied by) ``config.json``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def build_reward_standin(name: str, out_dir: str | Path, *, seed: int = 1) -> Path:
    """A reward model of the stand-in ``name``'s family: ``*ForSequenceClassification`` with one
    label on a stand-in's random weights, with its tokenizer (a user's reward model shares the
    policy's chat template). Returns ``Path(out_dir)``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy = build_standin(name, Path(out_dir) / "policy", seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
    out = Path(out_dir)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(policy).save_pretrained(out)
    return out
