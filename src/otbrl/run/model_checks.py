"""The preflight's checks against the model itself, before its weights load: read from its
``config.json`` or a meta-device copy of the architecture (no memory) — the context fits its
positions, the precision this device, the parallel layout its heads, the fused head its logits,
LoRA its modules, a saved adapter its shapes and a distillation teacher the policy's
tokenizer. Each problem is a ``ConfigError`` naming the key to change."""

from __future__ import annotations

from otbrl.config import Config, ConfigError
from otbrl.data import get_task
from otbrl.engine.dims import KEYS as DIM_KEYS
from otbrl.engine.dims import ParallelDims
from otbrl.engine.precision import check_precision_device
from otbrl.models import DEFAULT_SIZE, random_causal_lm, resolve_model_dir
from otbrl.models.lora import check_adapter_fits, linear_module_names


def check_context(cfg: Config, longest_prompt: int) -> None:
    """The longest prompt plus the response budget fits the model's positions (both rollout
    backends refuse more; this says so before the model loads, naming the key)."""
    if cfg.model.path == "builtin":
        size = {**DEFAULT_SIZE, **get_task(cfg.data.task).model_size}
        positions = size["max_position_embeddings"]
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(resolve_model_dir(cfg.model.path))
        except Exception as err:  # a broken config.json: transformers raises many types
            first = (str(err).splitlines() or [type(err).__name__])[0]
            raise ConfigError(
                f"'model.path': cannot read the model config in '{cfg.model.path}': {first}",
                "model.path",
            ) from None
        positions = getattr(config, "max_position_embeddings", None)
    context = longest_prompt + cfg.rollout.max_new_tokens
    if isinstance(positions, int) and context > positions:
        room = positions - longest_prompt  # what a response may take beside the longest prompt
        raise ConfigError(
            f"'data.max_response_length': the longest prompt ({longest_prompt} tokens) plus the "
            f"response budget ({cfg.rollout.max_new_tokens}) is {context} tokens, more than the "
            f"model's {positions} positions: lower data.max_response_length"
            f"{f' to {room} or less' if room > 0 else ''}, or shorten the prompts "
            "(data.max_prompt_length with data.overlong_prompts=filter or truncate_left)",
            "data.max_response_length",
        )


def check_token_budgets(cfg: Config, context: int) -> None:
    """A token budget per micro-batch holds the longest sequence the run can make (the longest
    prompt plus the response budget, ``context`` tokens): a row over it would have no
    micro-batch to run in, found only when such a row is sampled, hours in."""
    for key, budget in (
        ("actor.max_tokens_per_micro_batch", cfg.actor.max_tokens_per_micro_batch),
        ("critic.max_tokens_per_micro_batch", cfg.critic.max_tokens_per_micro_batch),
    ):
        if budget is not None and budget < context:
            raise ConfigError(
                f"'{key}' ({budget}) is smaller than the longest sequence the run can make: the "
                f"longest prompt plus the response budget is {context} tokens; set it to at "
                f"least {context}",
                key,
            )


def check_model_settings(cfg: Config, dims: ParallelDims) -> list[str]:
    """``model.precision`` on this device and ``model.lora`` against the model's modules, on a
    meta-device copy of the architecture (no weights load). Returns the notes to print at
    start (bf16 emulated on this CPU); raises ``ConfigError`` naming the key."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    note = check_precision_device(cfg.model.precision, device)
    if dims.tp > 1 or dims.sp > 1:
        _check_layout_fits_model(cfg.model.path, dims)
    if dims.fused and cfg.model.path != "builtin":
        _check_fused_head_fits_model(cfg)
    lora = cfg.model.lora
    if lora.rank:
        if dims.tp > 1:
            raise ConfigError(
                "'model.lora.rank': LoRA does not compose with tensor parallelism here (the TP "
                "plan shards the plain linear layers peft replaces); use FSDP2 "
                "(actor.strategy=fsdp) or Ulysses sequence parallelism",
                "model.lora.rank",
            )
        model = _meta_model(cfg)
        names = linear_module_names(model)
        targets = lora.target_modules
        if not isinstance(targets, str) and not set(targets) & set(names):
            raise ConfigError(
                f"'model.lora.target_modules' {list(targets)} names no linear layer of the "
                f"model; its linear layers are {names}",
                "model.lora.target_modules",
            )
        if lora.adapter_path is not None:
            try:
                check_adapter_fits(model, lora.adapter_path)
            except (ValueError, OSError) as err:
                key = "model.lora.adapter_path"
                why = str(err).removeprefix("adapter_path: ")
                raise ConfigError(f"'{key}': {why}", key) from None
    return [note] if note else []


def _text_config(path: str):
    """The HF config of the model at ``path`` (its language model's, for a multimodal one)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_dir(path))
    return getattr(config, "text_config", None) or config


def _check_layout_fits_model(path: str, dims: ParallelDims) -> None:
    """The TP size divides the attention heads, KV heads and MLP width of the model at ``path``
    (each rank holds whole heads), and the Ulysses size its attention heads (KV heads are
    replicated up): read from config.json, so a layout the model cannot take is one line, not a
    traceback per rank after the weights load."""
    fields = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    if path == "builtin":
        sizes = {k: DEFAULT_SIZE[k] for k in fields}
    else:
        config = _text_config(path)
        sizes = {k: getattr(config, k, None) for k in fields}
        sizes["num_key_value_heads"] = sizes["num_key_value_heads"] or sizes["num_attention_heads"]
    checks = [(DIM_KEYS["tp"], dims.tp, fields), (DIM_KEYS["sp"], dims.sp, fields[:1])]
    for key, size, names in checks:
        for name in names:
            if size > 1 and sizes[name] % size:
                raise ConfigError(
                    f"'{key}' is {size}, which does not divide the model's {name} "
                    f"({sizes[name]}, {path}): pick a size that divides it, or shard with "
                    "FSDP2 (actor.strategy=fsdp)",
                    key,
                )


def _check_fused_head_fits_model(cfg: Config) -> None:
    """The fused head computes the statistics from hidden · W_headᵀ (+ bias): a model whose
    logits are transformed after its head (Gemma 2's ``final_logit_softcapping``, Cohere's
    ``logit_scale``) would get statistics of other logits, silently."""
    config = _text_config(cfg.model.path)
    for name, neutral in (("final_logit_softcapping", None), ("logit_scale", 1.0)):
        value = getattr(config, name, None)
        if value not in (None, neutral):
            raise ConfigError(
                f"'actor.use_fused_kernels': the fused lm_head computes hidden · W_headᵀ, but "
                f"{cfg.model.path} transforms its logits after the head ({name}={value}); set "
                "actor.use_fused_kernels=false",
                "actor.use_fused_kernels",
            )


def _meta_model(cfg: Config):
    """The policy's architecture on the meta device (module names and shapes, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        if cfg.model.path == "builtin":  # its vocabulary does not change a linear layer
            return random_causal_lm("llama", vocab_size=64, **DEFAULT_SIZE)
        config = AutoConfig.from_pretrained(resolve_model_dir(cfg.model.path))
        return AutoModelForCausalLM.from_config(config)


def check_teacher(cfg: Config, tokenizer, context: int, dims: ParallelDims) -> list[str]:
    """The distillation teacher (``algorithm.distill.teacher_path``) before any weights load:
    a model directory whose tokenizer maps every token to the id the policy's ``tokenizer``
    does (the teacher scores the policy's sampled ids), whose embedding covers those ids, whose
    positions hold ``context`` tokens, whose heads take the parallel layout and whose precision
    this device runs. Returns the start-up notes; raises ``ConfigError`` naming the key."""
    import torch

    from otbrl.models import load_tokenizer

    key, d = "algorithm.distill.teacher_path", cfg.algorithm.distill
    try:
        path = resolve_model_dir(d.teacher_path)
        theirs = load_tokenizer(path)
        config = _text_config(str(path))
    except Exception as err:  # a missing dir (ValueError) or what transformers raises
        first = (str(err).splitlines() or [type(err).__name__])[0].removeprefix("path: ")
        raise ConfigError(f"'{key}': {first}", key) from None
    ours, their_vocab = tokenizer.get_vocab(), theirs.get_vocab()
    if ours != their_vocab:
        missing = sorted(set(ours) - set(their_vocab))
        moved = sorted(t for t in set(ours) & set(their_vocab) if ours[t] != their_vocab[t])
        example = (
            f"{missing[0]!r} is not in the teacher's"
            if missing
            else f"{moved[0]!r} is id {ours[moved[0]]} in the policy's, {their_vocab[moved[0]]} "
            "in the teacher's"
            if moved
            else f"the teacher's has {len(their_vocab) - len(ours)} more tokens"
        )
        raise ConfigError(
            f"'{key}': the teacher's tokenizer ({len(their_vocab)} tokens) is not the policy's "
            f"({len(ours)} tokens; {example}): the teacher scores the policy's token ids, so "
            "both must share one vocabulary",
            key,
        )
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < len(tokenizer):
        raise ConfigError(
            f"'{key}': the teacher's embedding has {vocab} rows, fewer than the tokenizer's "
            f"{len(tokenizer)} tokens",
            key,
        )
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and context > positions:
        raise ConfigError(
            f"'{key}': the longest prompt plus the response budget is {context} tokens, more "
            f"than the teacher's {positions} positions",
            key,
        )
    if dims.tp > 1 or dims.sp > 1:
        _check_layout_fits_model(str(path), dims)
    if d.precision is None:  # the policy's: model.precision was checked already
        return []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    note = check_precision_device(d.precision, device, "algorithm.distill.precision")
    return [note] if note else []
