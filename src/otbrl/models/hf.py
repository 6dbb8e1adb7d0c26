"""Build a tiny random-init causal LM for a built-in task, and load any local HF model directory.

Both go through the same Hugging Face code paths: ``build_tiny_model`` writes a directory with
``save_pretrained`` that ``load_model_and_tokenizer`` reads back exactly as it reads a real model.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from otbrl.data.tasks import get_task
from otbrl.models.config import DTYPE_NAMES
from otbrl.models.tokenizer import build_tokenizer

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
# The feasibility probe's size (NOTES): ~660k parameters, learns 2-digit addition on 2 CPU cores.
DEFAULT_SIZE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}


def random_causal_lm(
    arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **config
) -> PreTrainedModel:
    """A random-init ``arch`` causal LM built from config fields (``vocab_size``,
    ``hidden_size``, ...); the weights depend only on ``seed``, ``dtype`` and the config, and the
    global RNG is left untouched. The one builder behind ``build_tiny_model``, the tests and
    benchmarks. ``dtype``: the weights are created in it (a bfloat16 7 B model never holds an
    fp32 copy)."""
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {sorted(ARCHS)}, got {arch!r}")
    config_cls, model_cls = ARCHS[arch]
    default = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            return model_cls(config_cls(**config)).to(dtype)
        finally:
            torch.set_default_dtype(default)


def build_tiny_model(
    out_dir: str | Path, *, task: str = "arithmetic", arch: str = "llama", seed: int = 0, **size
) -> Path:
    """Random-init a tiny causal LM plus a task-alphabet tokenizer and save both to ``out_dir``.

    Args:
        out_dir: directory to write (created; existing files are overwritten).
        task: built-in task whose alphabet sizes the vocabulary (see ``otbrl.data.get_task``).
        arch: ``"llama"`` or ``"qwen2"``.
        seed: seeds the weight initialisation (the global RNG state is left untouched).
        **size: overrides of ``DEFAULT_SIZE`` keys (``hidden_size``, ``num_hidden_layers``, ...),
            laid over the task's own ``model_size`` (e.g. a long-response task's positions).

    Returns:
        ``Path(out_dir)``, holding ``config.json``, ``model.safetensors``, the tokenizer files
        and the chat template; ``load_model_and_tokenizer(out_dir)`` loads it.
    """
    unknown = sorted(set(size) - set(DEFAULT_SIZE))
    if unknown:
        raise ValueError(
            f"size: unknown keys {unknown}; expected a subset of {sorted(DEFAULT_SIZE)}"
        )
    task_obj = get_task(task)
    tokenizer = build_tokenizer(task_obj.alphabet, tool_tokens=bool(task_obj.tools))
    model = random_causal_lm(
        arch,
        seed=seed,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**DEFAULT_SIZE, **task_obj.model_size, **size},
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_model_and_tokenizer(
    path: str | Path, *, dtype: str = "float32", device: str = "cpu", **model_kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local Hugging Face directory.

    Args:
        path: directory with ``config.json`` and weights (``save_pretrained`` layout).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: torch device for the weights.
        **model_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (e.g.
            ``attn_implementation``).

    Returns:
        ``(model, tokenizer)``: the tokenizer pads on the left and always has a pad token (the
        EOS token when the model ships none); the model's generation config carries that pad id
        and stops at every id in ``eos_token_ids``.
    """
    path = _model_dir(path, dtype)
    tokenizer = load_tokenizer(path)
    return load_model(path, tokenizer, dtype=dtype, device=device, **model_kwargs), tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local HF model directory, set up as ``load_model_and_tokenizer``
    sets it up (padding on the left, a pad token: the EOS when the model ships none) — loaded
    once per run, before the model (``otbrl.run.plan``). ``ValueError`` without an EOS token."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"path: the tokenizer in {str(path)!r} has no EOS token to end responses")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    **model_kwargs,
) -> PreTrainedModel:
    """The causal LM of a local HF directory, its generation config padding with
    ``tokenizer``'s pad id and stopping at every id of ``eos_token_ids`` (arguments as
    ``load_model_and_tokenizer``'s)."""
    path = _model_dir(path, dtype)
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], **model_kwargs)
    model.to(device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos_token_ids(model, tokenizer)
    return model


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS plus the generation config's."""
    ids = [tokenizer.eos_token_id]
    extra = model.generation_config.eos_token_id
    for i in extra if isinstance(extra, list | tuple) else [extra]:
        if i is not None and i not in ids:
            ids.append(int(i))
    return ids


def load_value_model(path: str | Path, *, dtype: str = "float32", device: str = "cpu"):
    """A value model from a causal-LM directory: ``AutoModelForTokenClassification`` with one
    label, the decoder initialised from the checkpoint and a fresh scalar head (the convention
    of verl and OpenRLHF). Dropout before the head is off, so training and scoring agree.

    Returns the model; ``model(...).logits`` is [B, L, 1], the value of each prefix.
    """
    path = _model_dir(path, dtype)
    # the lm_head is unused and the score head is new: transformers' warnings say just that
    with quiet_loading(errors_only=True):
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=DTYPES[dtype]
        )
    return model.to(device)


@contextlib.contextmanager
def quiet_loading(errors_only: bool = False):
    """No "Loading weights" bar per load (a run loads up to three models; our own bar and
    log say what happens), and optionally transformers' warnings silenced too."""
    from transformers.utils import logging as hf_logging

    bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    if errors_only:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "pytorch_model.bin.index.json")  # fmt: skip


def resolve_model_dir(path: str | Path) -> Path:
    """A model as a local directory: ``path`` itself when it is a directory with
    ``config.json``, else a Hugging Face hub id (``"Qwen/Qwen2.5-0.5B"``) looked up in the local
    HF cache only (``HF_HOME`` / ``HF_HUB_CACHE``; nothing is downloaded).

    Raises ``ValueError`` naming ``path``: a local path that does not exist (one no hub id can
    be, or one under a directory that exists here, such as ``runs/x``), an id that is not
    cached (with the command that fetches it), not a model directory, or one without weights.
    """
    local = Path(path)
    if not local.exists() and not _looks_like_hub_id(str(path)):
        raise ValueError(
            f"path: {str(path)!r} does not exist{_siblings(local)}; pass a model directory "
            "(one with config.json) or a Hugging Face hub id (org/name)"
        )
    if not local.exists():
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            local = Path(snapshot_download(str(path), local_files_only=True))
        except LocalEntryNotFoundError:
            raise ValueError(
                f"path: {str(path)!r} is not a local directory nor in the local Hugging Face "
                f"cache; fetch it where there is internet with `hf download {path}` (same "
                "HF_HOME), or pass a model directory"
            ) from None
    if not (local / "config.json").is_file():
        what = "a directory without config.json" if local.is_dir() else "not a directory"
        raise ValueError(
            f"path: {str(path)!r} is {what}: expected a local model directory with config.json "
            "(or a Hugging Face hub id in the local cache)"
        )
    if not any((local / name).is_file() for name in _WEIGHTS) and not any(
        local.glob("*.safetensors")
    ):
        raise ValueError(
            f"path: {str(local)!r} has a config.json but no weights (expected "
            f"model.safetensors, sharded *.safetensors with an index, or pytorch_model.bin)"
        )
    return local


# one part of a hub id: letters, digits, "-", "_", "." (not first)
_HUB_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _looks_like_hub_id(text: str) -> bool:
    """An "org/name" or a "name" in the characters hub ids take, and not under a directory that
    exists here: ``runs/x`` with a ``runs/`` folder is a path mistyped, not a repository."""
    parts = text.split("/")
    if len(parts) > 2 or not all(_HUB_PART.fullmatch(part) for part in parts):
        return False
    return len(parts) == 1 or not Path(parts[0]).is_dir()


def _siblings(local: Path) -> str:
    """What the missing path's folder holds, when that folder exists (a typo shows)."""
    folder = local.parent
    if str(folder) in ("", ".") or not folder.is_dir():
        return ""
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return f" ({folder} holds: {shown or 'nothing'})"


def _model_dir(path: str | Path, dtype: str) -> Path:
    """``path`` as a local model directory (``resolve_model_dir``) after checking ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return resolve_model_dir(path)
