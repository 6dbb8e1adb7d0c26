"""A user-style HF model directory: trained byte-level BPE, chat template, tied Qwen2, safetensors.

What a user brings with ``model.path``, in miniature: a real BPE with merges (not the built-in
character vocabulary), ChatML-style special tokens and template, grouped-query attention, tied
embeddings and q/k/v biases (Qwen2), saved with ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML with a tools section and tool answers wrapped in <tool_response>, as Qwen2.5-style
# templates do (written for this test).
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is the sum of 12 and 30? The answer is 42.",
    "Please add the numbers below and explain every step of the work.",
    "The quick brown fox jumps over the lazy dog, then runs back home.",
    "Reinforcement learning from rewards: sample, score, update the policy.",
    "def add(a, b):\n    return a + b\n",
] * 20
USER_MESSAGES = [
    "What is 7 plus 5?",
    "Explain the sum of 12 and 30.",
    "Add the numbers: 3, 4 and 9.",
    "Why does the fox jump?",
    "Write a function that adds two numbers.",
    "Hi!",
]


def byte_level_tokenizer(
    specials: list[str],
    *,
    eos: str,
    pad: str | None = None,
    bos: str | None = None,
    chat_template: str,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE of 400 tokens trained on ``CORPUS`` with ``specials`` (the given EOS, pad
    and BOS among them; None: the tokenizer has none) and ``chat_template``."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(CORPUS, trainer)
    tokens = {"eos_token": eos, "pad_token": pad, "bos_token": bos}
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token=None,
        chat_template=chat_template,
        **{k: v for k, v in tokens.items() if v is not None},
    )  # fmt: skip


def build_user_style_model(
    out_dir: str | Path, *, seed: int = 0, chat_template=CHATML, max_positions: int = 256
) -> Path:
    """Write the directory; returns its path (loadable with ``load_model_and_tokenizer``)."""
    tok = byte_level_tokenizer(
        SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", chat_template=chat_template
    )
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            # Random init is near-uniform over 400 tokens; a wider spread makes samples vary
            # in length (stops) and keeps top-k tests meaningful.
            model.model.embed_tokens.weight.mul_(8.0)
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def chat_prompts(tokenizer, messages=USER_MESSAGES) -> list[list[int]]:
    """Token ids of one-turn chat prompts, generation prompt on (no padding)."""
    out = []
    for m in messages:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out
