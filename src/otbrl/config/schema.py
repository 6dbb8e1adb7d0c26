"""The configuration schema: OmegaConf structured dataclasses, one per group, with their defaults.

Imports nothing from otbrl but the error type. Loading (YAML + dotted overrides) is
``otbrl.config.load``; the checks the schema alone can decide are ``otbrl.config.checks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from otbrl.errors import ConfigError  # noqa: F401  (the public name is otbrl.config.ConfigError)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet (verl's row schema)
    # parquet validation rows (same schema); empty: none, or the task's
    val_files: list[str] = field(default_factory=list)
    # a built-in task ("arithmetic" | "digit_sum" | "tool_arithmetic") as the data when no
    # files are given (it brings its preset, otbrl.config.presets); None: the built-in model's
    # "arithmetic", and for a user's model no fallback (data.train_files is required)
    task: str | None = None
    train_batch_size: int = 32  # prompts per RL step
    # validation prompts: a seeded sample of this many rows of data.val_files; None: all of
    # them (the built-in task: 500)
    val_size: int | None = None
    max_prompt_length: int = 512  # tokens, chat template included
    max_response_length: int = 512  # tokens per response (multi-turn: observations included)
    # a prompt longer than max_prompt_length: "error" (at start, naming the row) | "filter"
    # (dropped, counted, reported) | "truncate_left" (its first tokens cut)
    overlong_prompts: str = "error"
    # render prompts with the tokenizer's chat template; false: the messages' text as written
    # (base models without a template)
    apply_chat_template: bool = True
    # seeds the shuffling of the training rows and the validation sample
    seed: int = 0


@dataclass
class LoraConfig:
    """LoRA adapters through ``peft`` (``model.lora.rank`` > 0): only they are trained, the
    reference policy is the same model with its adapters disabled."""

    rank: int = 0  # adapter rank r; 0 = off (full fine-tuning)
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input while training
    # "all-linear" (every linear layer of the decoder blocks, not the lm_head) or a list of
    # module names, e.g. [q_proj, v_proj]
    target_modules: Any = "all-linear"
    # a saved PEFT adapter directory to start from (adapter_config.json); None: fresh adapters
    adapter_path: str | None = None
    # how vLLM gets the trained adapters: "merged" (W0 + B·A pushed as plain weights through
    # reload_weights) | "adapter" (the adapter alone, served by vLLM's LoRA support)
    sync: str = "merged"


@dataclass
class ModelConfig:
    # a local HF model directory, a hub id in the local HF cache, or "builtin" (the tiny
    # model, warm-started by SFT on its task)
    path: str = "builtin"
    # 32-true (fp32 weights, state and compute) | bf16-mixed (fp32 master weights and AdamW
    # state, bf16 forward/backward, fp32 gradient reduction) | bf16-true (bf16 weights and
    # state); 32-true by default: measured faster on CPUs without bf16 instructions (README)
    precision: str = "32-true"
    # recompute each decoder block's activations in the backward instead of keeping them
    # (less memory, one more forward); off by default: it did not pay at the demo's size
    gradient_checkpointing: bool = False
    use_remove_padding: bool = False  # packed [1, nnz] forward instead of padded [B, L]
    lora: LoraConfig = field(default_factory=LoraConfig)


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
class ServerConfig:
    """vLLM OpenAI servers (``rollout.mode=server``, ``otbrl.rollout.server``)."""

    # servers the user started (e.g. on other hosts: see the README's launch recipes); empty:
    # otbrl starts num_servers on 127.0.0.1 and stops them at the end
    urls: list[str] = field(default_factory=list)
    num_servers: int = 1  # servers otbrl starts when urls is empty
    # the name the servers serve the policy under (--served-model-name); urls are checked
    served_model_name: str = "policy"
    startup_timeout_s: float = 300.0  # a started server must answer within this
    request_timeout_s: float = 300.0  # the longest one HTTP request may take
    max_restarts: int = 2  # restarts of a started server that died before the run fails
    # where the trainer writes weight buckets for the servers to load (every server must see
    # it); null: a fresh directory in /dev/shm, removed at the end
    weights_dir: str | None = None
    bucket_mb: float = 64.0  # one weight bucket: the trainer holds one at a time


@dataclass
class RolloutConfig:
    name: str = "hf"  # "hf" (the training model's own sampler) | "vllm"
    # "colocated": the engine of rollout.name in the trainer's process | "server": vLLM
    # OpenAI servers (rollout.server; needs rollout.name=vllm)
    mode: str = "colocated"
    # trainer.max_staleness > 0: a batch sampled by weights older than current − k is
    # "drop"ped (and counted) or the producer "wait"s before sampling ahead that far
    stale_samples: str = "wait"
    # trainer.max_staleness > 0: a weight update keeps the requests in flight (vLLM's
    # /pause?mode=keep; they go on with the new weights, each token's version recorded)
    # instead of waiting for them to finish
    partial_rollout: bool = False
    # rollout.mode=server with tools: the most samples whose agent loops (one per sample) are
    # in flight at once — the load on the tools and the servers
    max_concurrent_trajectories: int = 64
    n: int = 8  # responses per prompt
    # sampling temperature (the trainer's log-probs use the same one)
    temperature: float = 1.0
    # nucleus sampling; 1.0 = off
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # the response budget: model and (multi-turn) observation tokens together
    max_new_tokens: int = "${data.max_response_length}"  # type: ignore[assignment]
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class ActorConfig:
    # AdamW learning rate (1e-6: verl's and TRL's default for full fine-tuning; the built-in
    # model's preset: 3e-4)
    lr: float = 1e-6
    warmup_steps: int = 20  # linear warmup of optimizer steps; a cold AdamW can wreck the policy
    # AdamW weight decay
    weight_decay: float = 0.0
    # passes over each step's batch
    ppo_epochs: int = 1
    # prompts per optimizer step (x rollout.n sequences); None = the whole step batch
    ppo_mini_batch_size: int | None = None
    # at most this many sequences per forward/backward (the last micro-batch may be smaller;
    # gradients are accumulated exactly, as if the mini-batch ran at once)
    micro_batch_size: int = 8
    # PPO clip: the ratio's lower bound is 1 - this
    clip_ratio_low: float = 0.2
    # PPO clip: the ratio's upper bound is 1 + this (DAPO's clip-higher: > low)
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg_mode: str = "token-mean"
    # entropy bonus weight in the policy loss; 0 = off
    entropy_coeff: float = 0.0
    # add a KL-to-reference term to the loss (builds a frozen reference)
    use_kl_loss: bool = False
    # weight of the KL loss term
    kl_loss_coef: float = 0.001
    # KL estimator: k1 | k2 | k3 (= low_var_kl) | abs, '+' for straight-through
    kl_loss_type: str = "low_var_kl"
    # global gradient-norm clip
    grad_clip: float = 1.0
    # fuse the lm_head with the token statistics (no [T, V] logits kept)
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
    lr: float = 1e-5  # the critic's learning rate (verl's default; the built-in model's: 1e-3)
    # linear warmup of the critic's optimizer steps
    warmup_steps: int = 0
    # AdamW weight decay of the critic
    weight_decay: float = 0.0
    # critic passes over each step's batch
    ppo_epochs: int = 1
    cliprange_value: float | None = 0.5  # None: no value clipping
    # at most this many sequences per critic forward/backward
    micro_batch_size: int = 8
    # the critic's global gradient-norm clip
    grad_clip: float = 1.0


@dataclass
class OTBConfig:
    # baseline of each sample from the other samples of its group only
    leave_one_out: bool = False
    # W_t weights: logit_gradient (1 - 2π + Σπ²) | uniform (a token-count baseline)
    energy: str = "logit_gradient"


@dataclass
class AlgorithmConfig:
    # optimal_token_baseline | tir_optimal_token_baseline | grpo | rloo | gae | ...
    adv_estimator: str = "optimal_token_baseline"
    # discount (gae)
    gamma: float = 1.0
    # GAE lambda
    lam: float = 1.0
    # GRPO: divide by the group's reward std (false: Dr. GRPO)
    norm_adv_by_std_in_grpo: bool = True
    # OTB: no baseline where a group has no samples left
    handle_zero_tail: bool = True
    # subtract kl_coef · KL(policy || reference) from the token rewards
    use_kl_in_reward: bool = False
    # weight of the in-reward KL
    kl_coef: float = 0.001
    # correction for sampling with a rollout engine whose log-probs differ from the trainer's:
    # "none" | "token_tis" (w = min(exp(old − rollout), C)) | "seq_mis" (drop sequences whose
    # ratio exp(Σ(old − rollout)) leaves [1/C, C]); C = rollout_is_cap
    rollout_correction: str = "none"
    # C of rollout_correction and off_policy (>= 1)
    rollout_is_cap: float = 2.0
    # the objective for samples drawn by an older policy (trainer.max_staleness > 0):
    # "none" (PPO ratio against the trainer's log-probs, no behaviour weight) | "tis"
    # (× min(π_prox/π_behave, C): rollout_correction=token_tis) | "decoupled" (AReaL: PPO ratio
    # against π_prox, × π_prox/π_behave where ≤ C, else 0); π_prox = the trainer's log-probs at
    # the start of the update, π_behave = the rollout's; OTB's W takes the weights squared
    off_policy: str = "none"
    otb: OTBConfig = field(default_factory=OTBConfig)


@dataclass
class CodeRewardConfig:
    """The sandbox model-written code runs in (``codecontests``, ``apps``, ``codeforces``,
    ``taco`` rows; ``otbrl.rewards.sandbox``): limits of one run of one solution."""

    cpu_s: float = 10.0  # CPU seconds
    wall_s: float = 10.0  # seconds per test input (the whole run: one more)
    memory_mb: int = 1024  # address space
    max_workers: int = 4  # sandboxed runs at once in this process
    # run model code without namespaces where the OS cannot make them (as this user, with
    # only a time limit); false: such a run is refused, before any model loads
    allow_unsandboxed: bool = False


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: the last ``len`` tokens of the response budget
    (``rollout.max_new_tokens``) cost linearly up to ``penalty`` (0 = off)."""

    len: int = 0  # tokens before the budget's end where the penalty ramps up; 0 = off
    penalty: float = 1.0  # the penalty at the budget's end (the reward loses up to this much)


@dataclass
class RewardModelConfig:
    """A learned reward model (``otbrl.rewards.reward_model``): an HF
    ``AutoModelForSequenceClassification`` directory with one label; the trained reward is the
    rule reward + ``weight`` × its score."""

    path: str | None = None  # None: no reward model
    weight: float = 1.0  # the trained reward is the rule reward + weight x the model's score
    micro_batch_size: int = 16  # conversations per forward


@dataclass
class RewardConfig:
    function: str | None = None  # built-in name or "path/to/file.py:fn"; None -> by data_source
    on_error: str = "raise"  # "raise" | "zero"
    # a call that runs longer is an error, handled by on_error (a hung verifier would otherwise
    # stall the run forever); 0 = no limit
    timeout_s: float = 60.0
    # how the MATH sources (lighteval/MATH, MATH-500) are checked: "verl" (string
    # normalisation, verl's default) | "math_verify" (the math-verify package)
    math_backend: str = "verl"
    # score in this many worker processes while the policy computes its statistics (0: in
    # the trainer's process, after sampling)
    workers: int = 0
    # reward.function takes lists (data_sources, solution_strs, ground_truths, extra_infos)
    # and returns one result per sample: one call per batch (per worker chunk)
    batched: bool = False
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)


@dataclass
class TrainerConfig:
    # RL steps (each: sample, score, update)
    total_steps: int = 800
    val_every: int = 50  # 0 = no validation
    save_every: int = 50  # steps between checkpoints (and one at the end); 0 = none
    # delete older checkpoints beyond the newest N (the disk this takes is printed at start);
    # 0 = keep all
    keep_last_checkpoints: int = 2
    # the run directory: metrics, summary, plots, checkpoints
    output_dir: str = "runs/default"
    # console | jsonl | tensorboard | wandb
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # seeds sampling, dropout and the warm start
    seed: int = 0
    resume: str = "auto"  # "auto" | "never" | path to a checkpoint
    # with resume=never: move an existing run in output_dir aside (to <output_dir>.old-<time>)
    # instead of refusing to start; nothing is deleted
    overwrite: bool = False
    # greedy validation (false: sample at val_temperature)
    val_greedy: bool = True
    val_temperature: float = 1.0  # used when val_greedy is false
    val_batch_size: int = 64  # prompts per validation generate call
    # at each validation, the first N validation samples (prompt, response or transcript,
    # reward) go to generations.jsonl (and TensorBoard / W&B tables); 0 = none
    log_generations: int = 4
    # stop early (after a final validation and checkpoint) once fit() has run this long;
    # 0 = no limit. The demo uses it to keep its 10-minute promise on a slower machine.
    max_wall_seconds: float = 0.0
    # abort when more optimizer steps than this were skipped in a row (non-finite gradients):
    # a run that only skips learns nothing
    max_skipped_steps: int = 5
    # how long a rank waits for the others in a collective, e.g. while rank 0 alone writes a
    # checkpoint's full model (a dead peer usually fails sooner: its sockets close)
    dist_timeout_s: float = 1800.0
    # asynchronous RL (rollout.mode=server): the producer samples and scores up to k batches
    # ahead of the update, so a sample's weights may be up to k updates old; 0 = synchronous
    max_staleness: int = 0


@dataclass
class SFTConfig:
    # the built-in model's warm start: learning rate (3e-3 sat on the edge of stability:
    # seeds that never learned on AMD EPYC hosts; 1e-3 reached 0.3 in 370-870 steps, 3 seeds)
    lr: float = 1e-3
    # warm start: demonstrations per step
    batch_size: int = 64
    # warm start: the most steps
    max_steps: int = 2000
    # warm start: stop at this greedy validation accuracy
    target_accuracy: float = 0.3
    # warm start: steps between accuracy checks
    eval_every: int = 25
    # warm-started models are cached here, keyed by their settings
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


def to_dict(cfg: Config) -> dict:
    """The resolved configuration as plain containers (for checkpoints and logs)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


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
