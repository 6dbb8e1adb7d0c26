"""Configuration schema: OmegaConf structured dataclasses, loaded from YAML + dotted overrides.

This module imports nothing from otbrl (it sits beside the floors). It checks what the schema
alone can decide: unknown keys (with a did-you-mean), types, allowed values, ranges, and batch
divisibility. Checks that need the estimator registry (estimator name, Σπ² contradictions) live
in ``otbrl.run.plan.validate_config``, which the CLI calls before any model is loaded.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A user configuration problem; ``str(err)`` is one line naming the key."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet; empty -> built-in task
    val_files: list[str] = field(default_factory=list)
    task: str = "arithmetic"  # built-in task used when no files are given
    train_batch_size: int = 32  # prompts per RL step
    val_size: int = 500  # built-in task: number of validation prompts
    max_prompt_length: int = 64
    max_response_length: int = 4  # the demo: 3 answer digits + EOS; raise it for real data
    seed: int = 0


@dataclass
class ModelConfig:
    path: str = "builtin"  # local HF directory, or "builtin" (tiny model, SFT warm start)
    dtype: str = "float32"
    use_remove_padding: bool = False  # packed [1, nnz] forward instead of padded [B, L]


@dataclass
class VLLMConfig:
    """The in-process vLLM engine (``rollout.name=vllm``); one per data-parallel rank."""

    dtype: str = "float32"  # engine dtype; float32 matches an fp32 trainer's log-probs to 1e-5
    enforce_eager: bool = True  # no CUDA graphs / compilation: faster start
    gpu_memory_utilization: float = 0.5  # GPU only: the share of GPU memory vLLM may take
    kv_cache_gib: float = 1.0  # CPU only: KV-cache size
    enable_sleep_mode: bool = False  # GPU only: free weights and KV cache while training


@dataclass
class MultiTurnConfig:
    """Multi-turn tool use (``otbrl.rollout.agent``): on when ``tools`` is not empty."""

    tools: list[str] = field(default_factory=list)  # built-in names or "path/to/file.py:fn"
    format: str = "auto"  # "auto" | "hermes" | "compact" (auto: compact for the built-in model)
    max_turns: int = 4  # model turns per sample
    max_tool_response_tokens: int = 64  # each tool result is cut to this many tokens
    tool_timeout_s: float = 5.0  # a call running longer returns an error observation


@dataclass
class RolloutConfig:
    name: str = "hf"  # "hf" (the training model's own sampler) | "vllm"
    n: int = 8  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # the response budget: model and (multi-turn) observation tokens together
    max_new_tokens: int = "${data.max_response_length}"  # type: ignore[assignment]
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class ActorConfig:
    lr: float = 3e-4
    warmup_steps: int = 20  # linear warmup of optimizer steps; a cold AdamW can wreck the policy
    weight_decay: float = 0.0
    ppo_epochs: int = 1
    # prompts per optimizer step (x rollout.n sequences); None = the whole step batch
    ppo_mini_batch_size: int | None = None
    # at most this many sequences per forward/backward (the last micro-batch may be smaller;
    # gradients are accumulated exactly, as if the mini-batch ran at once)
    micro_batch_size: int = 64
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    use_fused_kernels: bool = False
    calculate_sum_pi_squared: Any = "auto"  # "auto" | "true" | "false" (YAML booleans accepted)
    # "auto": one process, or FSDP2 when torchrun starts several; "single" | "fsdp" | "tp"
    engine: str = "auto"
    tensor_parallel_size: int = 1  # engine=tp: ranks sharing one model's heads and vocabulary
    ulysses_sequence_parallel_size: int = 1  # ranks splitting each packed sequence


@dataclass
class CriticConfig:
    """The value model of PPO with GAE: ``AutoModelForTokenClassification(num_labels=1)``
    initialised from ``model_path`` (the policy's weights by default), trained with the clipped
    value loss on the actor's mini-batches, under the actor's engine."""

    enable: Any = "auto"  # "auto" (on when the estimator needs values) | "true" | "false"
    model_path: str | None = None  # None: the policy's model
    lr: float = 1e-3
    warmup_steps: int = 0
    weight_decay: float = 0.0
    ppo_epochs: int = 1
    cliprange_value: float | None = 0.5  # None: no value clipping
    micro_batch_size: int = 64
    grad_clip: float = 1.0


@dataclass
class OTBConfig:
    leave_one_out: bool = False
    energy: str = "logit_gradient"  # "logit_gradient" | "uniform"


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "optimal_token_baseline"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    handle_zero_tail: bool = True
    use_kl_in_reward: bool = False
    kl_coef: float = 0.001
    # correction for sampling with a rollout engine whose log-probs differ from the trainer's:
    # "none" | "token_tis" (w = min(exp(old − rollout), C)) | "seq_mis" (drop sequences whose
    # ratio exp(Σ(old − rollout)) leaves [1/C, C]); C = rollout_is_cap
    rollout_correction: str = "none"
    rollout_is_cap: float = 2.0
    otb: OTBConfig = field(default_factory=OTBConfig)


@dataclass
class RewardConfig:
    function: str | None = None  # built-in name or "path/to/file.py:fn"; None -> by data_source
    on_error: str = "raise"  # "raise" | "zero"
    # a call that runs longer is an error, handled by on_error (a hung verifier would otherwise
    # stall the run forever); 0 = no limit
    timeout_s: float = 60.0


@dataclass
class TrainerConfig:
    total_steps: int = 800
    val_every: int = 50  # 0 = no validation
    save_every: int = 0  # 0 = no checkpoints
    keep_last_checkpoints: int = 0  # delete older checkpoints beyond the newest N; 0 = keep all
    output_dir: str = "runs/default"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    seed: int = 0
    resume: str = "auto"  # "auto" | "never" | path to a checkpoint
    # with resume=never: move an existing run in output_dir aside (to <output_dir>.old-<time>)
    # instead of refusing to start; nothing is deleted
    overwrite: bool = False
    val_greedy: bool = True
    val_temperature: float = 1.0  # used when val_greedy is false
    val_batch_size: int = 256
    # stop early (after a final validation and checkpoint) once fit() has run this long;
    # 0 = no limit. The demo uses it to keep its 10-minute promise on a slower machine.
    max_wall_seconds: float = 0.0
    # abort when more optimizer steps than this were skipped in a row (non-finite gradients):
    # a run that only skips learns nothing
    max_skipped_steps: int = 5
    # how long a rank waits for the others in a collective, e.g. while rank 0 alone writes a
    # checkpoint's full model (a dead peer usually fails sooner: its sockets close)
    dist_timeout_s: float = 1800.0


@dataclass
class SFTConfig:
    lr: float = 3e-3
    batch_size: int = 64
    max_steps: int = 2000
    target_accuracy: float = 0.3
    eval_every: int = 25
    cache_dir: str = ".cache/otbrl"


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


_CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "rollout.name": ("hf", "vllm"),
    "rollout.vllm.dtype": ("float32", "bfloat16", "float16"),
    "rollout.multi_turn.format": ("auto", "hermes", "compact"),
    "algorithm.rollout_correction": ("none", "token_tis", "seq_mis"),
    "actor.loss_agg_mode": (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ),
    "actor.calculate_sum_pi_squared": ("auto", "true", "false"),
    "actor.engine": ("auto", "single", "fsdp", "tp"),
    "critic.enable": ("auto", "true", "false"),
    "algorithm.otb.energy": ("logit_gradient", "uniform"),
    "reward.on_error": ("raise", "zero"),
}
_LIST_KEYS = ("data.train_files", "data.val_files", "trainer.logger", "rollout.multi_turn.tools")
_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
_POSITIVE = (
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "rollout.n",
    "rollout.max_new_tokens",
    "rollout.multi_turn.max_turns",
    "rollout.multi_turn.max_tool_response_tokens",
    "rollout.multi_turn.tool_timeout_s",
    "actor.ppo_epochs",
    "actor.micro_batch_size",
    "critic.lr",
    "critic.ppo_epochs",
    "critic.micro_batch_size",
    "actor.tensor_parallel_size",
    "actor.ulysses_sequence_parallel_size",
    "trainer.total_steps",
    "trainer.val_batch_size",
    "sft.batch_size",
    "sft.lr",
    "actor.lr",
    "rollout.temperature",
    "trainer.val_temperature",
    "trainer.dist_timeout_s",
)
_NON_NEGATIVE = (
    "data.val_size",
    "rollout.top_k",
    "actor.warmup_steps",
    "actor.weight_decay",
    "actor.clip_ratio_low",
    "actor.clip_ratio_high",
    "actor.kl_loss_coef",
    "actor.grad_clip",
    "critic.warmup_steps",
    "critic.weight_decay",
    "critic.grad_clip",
    "algorithm.kl_coef",
    "trainer.val_every",
    "trainer.save_every",
    "trainer.keep_last_checkpoints",
    "trainer.max_wall_seconds",
    "trainer.max_skipped_steps",
    "actor.entropy_coeff",
    "reward.timeout_s",
    "sft.max_steps",
    "sft.eval_every",
)


def all_keys(node: Any = None, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema (``["data.train_files", ...]``)."""
    node = OmegaConf.structured(Config) if node is None else node
    keys = []
    for name in node:
        value = node._get_node(name)
        dotted = f"{prefix}{name}"
        if isinstance(value, DictConfig):
            keys.extend(all_keys(value, dotted + "."))
        else:
            keys.append(dotted)
    return keys


def _did_you_mean(key: str) -> str:
    candidates = all_keys()
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not close:  # a typo in the leaf with the right group, e.g. "actor.lrr"
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        leaves = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        close = [by_leaf[leaves[0]]] if leaves else []
    return f" (did you mean '{close[0]}'?)" if close else ""


def _merge(
    base: DictConfig, other: DictConfig | ListConfig, source: str, key_hint: str = ""
) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or key_hint
        if type(err).__name__ in ("ConfigKeyError", "ConfigAttributeError"):
            raise ConfigError(
                f"unknown config key '{key}' in {source}{_did_you_mean(key)}", key
            ) from None
        msg = str(err).splitlines()[0]
        raise ConfigError(f"invalid value for '{key}' in {source}: {msg}", key) from None


def load_config(
    config_file: str | Path | None = None, overrides: list[str] | None = None
) -> Config:
    """Build a ``Config`` from defaults, an optional YAML file, then ``key=value`` overrides.

    Raises ``ConfigError`` (one line, naming the key) for unknown keys, bad types or values.
    """
    cfg = OmegaConf.structured(Config)
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file not found: '{path}'", "--config")
        try:
            loaded = OmegaConf.load(path)
        except Exception as err:  # YAML syntax errors come in several exception types
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"cannot parse config file '{path}': {first}", "--config") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file '{path}' must hold a mapping of groups", "--config")
        cfg = _merge(cfg, loaded, f"'{path}'")
    for item in overrides or []:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value", item)
        key, value = (part.strip() for part in item.split("=", 1))
        if key in _LIST_KEYS and not value.startswith("["):
            item = f"{key}=[{value}]"  # CLI shorthand: data.train_files=a.parquet
        try:
            dot = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as err:
            msg = str(err).splitlines()[0]
            raise ConfigError(f"cannot parse override '{item}': {msg}", key) from None
        cfg = _merge(cfg, dot, f"override '{item}'", key)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or ""
        msg = str(err).splitlines()[0]
        raise ConfigError(f"invalid value for '{key}': {msg}", key) from None
    assert isinstance(obj, Config)
    _normalize(obj)
    check_config(obj)
    return obj


def _normalize(cfg: Config) -> None:
    # tri-state keys take YAML booleans too
    for group, key in ((cfg.actor, "calculate_sum_pi_squared"), (cfg.critic, "enable")):
        value = getattr(group, key)
        if isinstance(value, bool):
            value = "true" if value else "false"
        setattr(group, key, str(value).lower())


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _floats(node: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, value) of every float in the config tree."""
    out = []
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            out.extend(_floats(value, f"{prefix}{f.name}."))
        elif isinstance(value, float):
            out.append((f"{prefix}{f.name}", value))
    return out


def check_config(cfg: Config) -> None:
    """Schema-level checks (values, ranges, divisibility); raises ``ConfigError``."""
    for key, value in _floats(cfg):
        # NaN passes every comparison check below and inf overflows at step 1
        if not math.isfinite(value):
            raise ConfigError(f"'{key}' must be a finite number, got {value}", key)
    if cfg.model.dtype == "float16":
        raise ConfigError(
            "'model.dtype' float16 is refused for training: otbrl keeps the weights and AdamW "
            "state in the model dtype, with no fp32 master weights nor loss scaling, and pure "
            "fp16 overflows on the first optimizer step; use model.dtype=bfloat16 (same memory) "
            "or float32",
            "model.dtype",
        )
    for key, choices in _CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"'{key}' must be one of {list(choices)}, got '{value}'{hint}", key)
    for key in _POSITIVE:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"'{key}' must be > 0, got {_get(cfg, key)}", key)
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"'{key}' must be >= 0, got {_get(cfg, key)}", key)
    if not 0.0 < cfg.rollout.top_p <= 1.0:
        raise ConfigError(
            f"'rollout.top_p' must be in (0, 1], got {cfg.rollout.top_p}", "rollout.top_p"
        )
    if not cfg.algorithm.rollout_is_cap >= 1.0:
        raise ConfigError(
            f"'algorithm.rollout_is_cap' must be >= 1, got {cfg.algorithm.rollout_is_cap}",
            "algorithm.rollout_is_cap",
        )
    vllm, defaults = cfg.rollout.vllm, VLLMConfig()
    if cfg.rollout.name != "vllm":
        for key in vars(defaults):
            if getattr(vllm, key) != getattr(defaults, key):
                raise ConfigError(
                    f"'rollout.vllm.{key}' is set but 'rollout.name' is "
                    f"'{cfg.rollout.name}'; set rollout.name=vllm or drop the key",
                    f"rollout.vllm.{key}",
                )
    multi, multi_defaults = cfg.rollout.multi_turn, MultiTurnConfig()
    if not multi.tools:
        for key in ("format", "max_turns", "max_tool_response_tokens", "tool_timeout_s"):
            if getattr(multi, key) != getattr(multi_defaults, key):
                raise ConfigError(
                    f"'rollout.multi_turn.{key}' is set but 'rollout.multi_turn.tools' is empty; "
                    "list the tools (e.g. rollout.multi_turn.tools=[calculator]) or drop the key",
                    f"rollout.multi_turn.{key}",
                )
    if not 0.0 < vllm.gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"'rollout.vllm.gpu_memory_utilization' must be in (0, 1], got "
            f"{vllm.gpu_memory_utilization}",
            "rollout.vllm.gpu_memory_utilization",
        )
    if not vllm.kv_cache_gib > 0:
        raise ConfigError(
            f"'rollout.vllm.kv_cache_gib' must be > 0, got {vllm.kv_cache_gib}",
            "rollout.vllm.kv_cache_gib",
        )
    if cfg.actor.clip_ratio_c <= 1.0:
        raise ConfigError(
            f"'actor.clip_ratio_c' must be > 1.0, got {cfg.actor.clip_ratio_c}",
            "actor.clip_ratio_c",
        )
    for key in ("algorithm.gamma", "algorithm.lam"):
        if not 0.0 <= _get(cfg, key) <= 1.0:
            raise ConfigError(f"'{key}' must be in [0, 1], got {_get(cfg, key)}", key)
    if not cfg.actor.clip_ratio_low < 1.0:
        raise ConfigError(
            f"'actor.clip_ratio_low' must be < 1 (the ratio's lower bound is 1 - it), got "
            f"{cfg.actor.clip_ratio_low}",
            "actor.clip_ratio_low",
        )
    if cfg.trainer.overwrite and cfg.trainer.resume != "never":
        raise ConfigError(
            "'trainer.overwrite' starts a new run (moving the old one aside): it needs "
            f"trainer.resume=never, got trainer.resume={cfg.trainer.resume}",
            "trainer.overwrite",
        )
    if not 0.0 <= cfg.sft.target_accuracy <= 1.0:
        raise ConfigError(
            f"'sft.target_accuracy' must be in [0, 1], got {cfg.sft.target_accuracy}",
            "sft.target_accuracy",
        )
    for name in cfg.trainer.logger:
        if name not in _LOGGERS:
            raise ConfigError(
                f"'trainer.logger' entries must be in {list(_LOGGERS)}, got '{name}'",
                "trainer.logger",
            )
    if cfg.trainer.resume not in ("auto", "never") and not Path(cfg.trainer.resume).exists():
        raise ConfigError(
            f"'trainer.resume' must be 'auto', 'never' or an existing checkpoint path, "
            f"got '{cfg.trainer.resume}'",
            "trainer.resume",
        )
    batch, mini = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    if mini is not None and (mini <= 0 or batch % mini != 0):
        raise ConfigError(
            f"'actor.ppo_mini_batch_size' ({mini}) must be a positive divisor of "
            f"'data.train_batch_size' ({batch}), or null for the whole step batch",
            "actor.ppo_mini_batch_size",
        )
    clip = cfg.critic.cliprange_value
    if clip is not None and not clip > 0:
        raise ConfigError(
            f"'critic.cliprange_value' must be > 0 or null (no clipping), got {clip}",
            "critic.cliprange_value",
        )
    if cfg.reward.function is not None and ":" in cfg.reward.function:
        file = cfg.reward.function.rsplit(":", 1)[0]
        if not Path(file).is_file():
            raise ConfigError(f"'reward.function' file not found: '{file}'", "reward.function")


def to_dict(cfg: Config) -> dict:
    """The resolved configuration as plain containers (for checkpoints and logs)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
