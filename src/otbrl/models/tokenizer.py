"""A tiny byte-level BPE tokenizer for a built-in task, wrapped as a Hugging Face tokenizer.

The vocabulary is the task's alphabet plus a few special tokens, so the model's embedding and
output layers stay tiny. The tokenizer is a byte-level BPE (``models.BPE`` +
``pre_tokenizers.ByteLevel`` + ``decoders.ByteLevel``) so that it survives the
``save_pretrained`` → ``AutoTokenizer.from_pretrained`` round trip unchanged, whatever model
type it is saved next to (see NOTES: a WordLevel tokenizer next to a ``qwen2`` config is
silently rebuilt as a byte-level one and loses spaces).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<system>", "<user>", "<assistant>")
# An explicit unknown token matters: without one, AutoTokenizer's Qwen2Tokenizer (picked for a
# ``qwen2`` config) adds its default "<|endoftext|>" past the model's vocabulary.
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)
# Tool tasks only (``build_tokenizer(..., tool_tokens=True)``), after the others: the ids of the
# tokenizers without them stay what they were.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Renders ``<bos><user>12+34=<assistant>`` for a one-turn prompt with the generation prompt on,
# and closes assistant turns with ``<eos>``: the same token that ends a sampled response.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "<{{ message['role'] }}>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# The tool tasks' template (tokenizers with ``TOOL_TOKENS``): also a ``tool`` role. A
# tool-calling turn ends with its ``</tool_call>`` (where generation stops, no ``<eos>``), a tool
# message renders as ``<tool_response>...</tool_response>``: the template is prefix-preserving,
# so observation tokens are its suffix difference (``otbrl.tools.formats``).
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "<tool_response>{{ message['content'] }}</tool_response>"
    "{% else %}"
    "<{{ message['role'] }}>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' and not message['content'].endswith('</tool_call>') %}"
    "{{ eos_token }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# ``data.apply_chat_template=false`` (base models, which often ship no template): the prompt is
# its messages' text as written, one message per line, with no role markers and no generation
# prompt — what verl and TRL feed a base model from a raw-text prompt column.
RAW_PROMPT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
)


def set_prompt_template(tokenizer, apply_chat_template: bool, where: str) -> None:
    """Make ``tokenizer`` render prompts the way ``data.apply_chat_template`` asks: its own chat
    template (which must exist: else a ``ValueError`` naming ``where`` and the key that helps),
    or ``RAW_PROMPT_TEMPLATE``."""
    if not apply_chat_template:
        tokenizer.chat_template = RAW_PROMPT_TEMPLATE
    elif not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of {where} has no chat template (common for base models): set "
            "data.apply_chat_template=false to feed each prompt's text as it is, or add a "
            "chat_template to its tokenizer_config.json"
        )


def build_tokenizer(alphabet: str, *, tool_tokens: bool = False) -> PreTrainedTokenizerFast:
    """Build a character-level byte-level-BPE tokenizer over ``alphabet`` plus special tokens.

    Args:
        alphabet: the characters the task uses (non-empty, ASCII only: one byte per character,
            so each character is exactly one token). Characters outside it are dropped when
            encoding, as a BPE without an unknown token does.
        tool_tokens: also add ``TOOL_TOKENS`` (tool-use tasks), one special token each.

    Returns:
        A ``PreTrainedTokenizerFast`` with pad/bos/eos and chat-role special tokens, the
        ``CHAT_TEMPLATE`` chat template (``TOOL_CHAT_TEMPLATE`` with ``tool_tokens``) and
        ``padding_side="left"``. Vocabulary size is
        ``len(SPECIAL_TOKENS) + len(set(alphabet))`` (+ 4 with ``tool_tokens``); special tokens
        take ids 0..6, then the characters, then the tool tokens.
    """
    if not isinstance(alphabet, str):
        raise TypeError(f"alphabet: expected a str, got {type(alphabet).__name__}")
    chars = sorted(set(alphabet))
    if not chars:
        raise ValueError("alphabet: expected at least one character, got an empty string")
    if any(ord(c) > 127 for c in chars):
        raise ValueError(f"alphabet: expected ASCII characters only, got {alphabet!r}")
    # The byte-level pre-tokenizer maps each byte to a printable stand-in (space -> 'Ġ'), so the
    # initial alphabet must be given in that mapped form.
    byte_map = pre_tokenizers.ByteLevel.alphabet()
    mapped = [_byte_level_char(c, byte_map) for c in chars]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        # No room for merges: one token per character keeps arithmetic digit-by-digit.
        vocab_size=len(SPECIAL_TOKENS) + len(mapped),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=mapped,
        limit_alphabet=len(mapped),
        show_progress=False,
    )
    tok.train_from_iterator(["".join(chars)], trainer=trainer)
    extra = list(ROLE_TOKENS) + (list(TOOL_TOKENS) if tool_tokens else [])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=extra,
        padding_side="left",
        chat_template=TOOL_CHAT_TEMPLATE if tool_tokens else CHAT_TEMPLATE,
    )


def _byte_level_char(char: str, byte_map: list[str]) -> str:
    """The byte-level stand-in of one ASCII character (identity for printable ones)."""
    mapped = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(
        char
    )[0][0]
    if mapped not in byte_map:  # defensive: the ByteLevel table covers all 256 bytes
        raise ValueError(f"alphabet: character {char!r} has no byte-level token")
    return mapped
