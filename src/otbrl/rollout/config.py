"""The rollout's settings (``rollout.*``): which backend samples, where it runs, the sampling
parameters, the in-process vLLM engine, the vLLM servers and the multi-turn agent loop — and
the closed sets of values the backends act on, declared here once. No torch: the CLI's schema
composes ``RolloutConfig`` and starts without it."""

from __future__ import annotations

from dataclasses import dataclass, field

from otbrl.errors import ConfigError
from otbrl.models.config import DTYPE_NAMES
from otbrl.settings import refuse_unset, setting
from otbrl.tools.formats import FORMATS

ROLLOUT_NAMES = ("hf", "vllm")  # rollout.name: the backends (HFRollout, VLLMRollout/servers)
ROLLOUT_MODES = ("colocated", "server")  # rollout.mode: in the trainer's process, or servers
WEIGHT_TRANSPORTS = ("auto", "file", "http")  # rollout.server.weight_transport
# rollout.stale_samples: a batch older than the staleness bound is dropped, or the producer
# waits before sampling that far ahead (otbrl.run.producer)
STALE_SAMPLES = ("drop", "wait")


@dataclass
class VLLMConfig:
    """The in-process vLLM engine (``rollout.name=vllm``); one per data-parallel rank."""

    # engine dtype; float32 matches an fp32 trainer's log-probs to 1e-5
    dtype: str = setting("float32", choices=DTYPE_NAMES, resume="fixed")
    # no CUDA graphs / compilation: faster start
    enforce_eager: bool = setting(True, resume="may_differ")
    # GPU only: the share of GPU memory vLLM may take
    gpu_memory_utilization: float = setting(0.5, gt=0, le=1, resume="may_differ")
    kv_cache_gib: float = setting(1.0, gt=0, resume="may_differ")  # CPU only: KV-cache size
    # GPU only: free weights and KV cache while training
    enable_sleep_mode: bool = setting(False, resume="may_differ")


@dataclass
class MultiTurnConfig:
    """Multi-turn episodes (``otbrl.rollout.agent``): on when ``tools`` or ``env`` is set — the
    tool environment, or an environment of the user's (``otbrl.envs``), one of them."""

    # built-in names or "path/to/file.py:fn"
    tools: list[str] = setting(default_factory=list, resume="fixed")
    # an environment factory make(row) -> env: "path/to/file.py:NAME", "module:NAME" or a
    # built-in name (docs/environments.md)
    env: str | None = setting(None, resume="fixed")
    # "auto" | "hermes" | "compact" (auto: compact for the built-in model)
    format: str = setting("auto", choices=FORMATS, resume="fixed")
    max_turns: int = setting(4, gt=0, resume="fixed")  # model turns per sample
    # each observation message (a tool result, an environment's turn) is cut to this many
    # tokens
    max_observation_tokens: int = setting(64, gt=0, resume="fixed")
    # a call running longer returns an error observation
    tool_timeout_s: float = setting(5.0, gt=0, resume="fixed")
    # an environment's make / reset / step running longer fails its sample
    env_timeout_s: float = setting(30.0, gt=0, resume="fixed")

    def check(self, at: str) -> None:
        """Its keys only with tools or an environment; the tools' own only with tools."""
        if self.tools and self.env is not None:
            raise ConfigError(
                f"'{at}tools' and '{at}env' are both set: the tool loop is an environment of "
                "its own; give one of them",
                f"{at}env",
            )
        if not self.tools and self.env is None:
            keys = ("format", "max_turns", "max_observation_tokens", "tool_timeout_s")
            fix = f"list the tools (e.g. {at}tools=[calculator]) or name an environment ({at}env)"
            refuse_unset(self, at, f"'{at}tools' and '{at}env' are unset", fix, keys)
        if self.env is None:
            refuse_unset(self, at, f"'{at}env' is unset", f"set {at}env", ["env_timeout_s"])
        elif not self.tools:
            why, fix = f"'{at}tools' is empty", f"list the tools ({at}tools)"
            refuse_unset(self, at, why, fix, ["format", "tool_timeout_s"])


@dataclass
class ServerConfig:
    """vLLM OpenAI servers (``rollout.mode=server``, ``otbrl.rollout.server``)."""

    # servers the user started (e.g. on other hosts: see docs/rollout.md's launch recipes); empty:
    # otbrl starts num_servers on this host, each on a Unix socket in a directory only this user
    # may enter, and stops them at the end
    urls: list[str] = setting(default_factory=list, resume="may_differ")
    # servers otbrl starts when urls is empty
    num_servers: int = setting(1, gt=0, resume="may_differ")
    # the name the servers serve the policy under (--served-model-name); urls are checked
    served_model_name: str = setting("policy", resume="may_differ")
    # a started server must answer within this
    startup_timeout_s: float = setting(300.0, gt=0, resume="may_differ")
    # the longest one HTTP request may take
    request_timeout_s: float = setting(300.0, gt=0, resume="may_differ")
    # restarts of a started server that died before the run fails
    max_restarts: int = setting(2, ge=0, resume="may_differ")
    # where the trainer writes weight buckets (with weight_transport=file every server must see
    # it); null: a fresh directory in /dev/shm, removed at the end
    weights_dir: str | None = setting(None, resume="may_differ")
    # how the servers get each update's buckets: "file" (read from weights_dir) | "http"
    # (fetched from the trainer, with a per-run token: no shared file system) | "auto" (http
    # for servers of urls without a weights_dir, else file)
    weight_transport: str = setting("auto", choices=WEIGHT_TRANSPORTS, resume="may_differ")
    # the trainer's address as the servers reach it (weight_transport=http; it listens there)
    weights_host: str = setting("127.0.0.1", resume="may_differ")
    # one weight bucket: the trainer holds one at a time
    bucket_mb: float = setting(64.0, gt=0, resume="may_differ")

    def check(self, at: str) -> None:
        """Each url an http(s) url, or ``http+unix://`` and a percent-encoded socket path."""
        for i, url in enumerate(self.urls):
            if not isinstance(url, str) or not url.startswith(
                ("http://", "https://", "http+unix://")
            ):
                raise ConfigError(
                    f"'{at}urls[{i}]' must be an http:// url (or http+unix://%2Fpath%2Fto.sock "
                    f"for a server's Unix socket), got {url!r}",
                    f"{at}urls",
                )


@dataclass
class RolloutConfig:
    # "hf" (the training model's own sampler) | "vllm"
    name: str = setting("hf", choices=ROLLOUT_NAMES, resume="fixed")
    # "colocated": the engine of rollout.name in the trainer's process | "server": vLLM
    # OpenAI servers (rollout.server; needs rollout.name=vllm)
    mode: str = setting("colocated", choices=ROLLOUT_MODES, resume="fixed")
    # trainer.max_staleness > 0: a batch sampled by weights older than current − k is
    # "drop"ped (and counted) or the producer "wait"s before sampling ahead that far
    stale_samples: str = setting("wait", choices=STALE_SAMPLES, resume="fixed")
    # trainer.max_staleness > 0: a weight update keeps the requests in flight (vLLM's
    # /pause?mode=keep; they go on with the new weights, each token's version recorded)
    # instead of waiting for them to finish
    partial_rollout: bool = setting(False, resume="fixed")
    # rollout.mode=server with tools: the most samples whose agent loops (one per sample) are
    # in flight at once — the load on the tools and the servers
    max_concurrent_trajectories: int = setting(64, gt=0, resume="may_differ")
    n: int = setting(8, gt=0, resume="fixed")  # responses per prompt
    # sampling temperature (the trainer's log-probs use the same one)
    temperature: float = setting(1.0, gt=0, resume="fixed")
    # nucleus sampling; 1.0 = off
    top_p: float = setting(1.0, gt=0, le=1, resume="fixed")
    top_k: int = setting(0, ge=0, resume="fixed")  # 0 = off
    # the response budget: model and (multi-turn) observation tokens together
    max_new_tokens: int = setting("${data.max_response_length}", gt=0, resume="fixed")
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)

    def check(self, at: str) -> None:
        """The vLLM engine's keys only with ``name=vllm``; the servers' only with
        ``mode=server``, which needs vLLM."""
        if self.name != "vllm":
            because = f"'{at}name' is '{self.name}'"
            refuse_unset(self.vllm, f"{at}vllm.", because, f"set {at}name=vllm")
        if self.mode == "server" and self.name != "vllm":
            raise ConfigError(
                f"'{at}mode=server' serves the policy with vLLM servers but '{at}name' is "
                f"'{self.name}'; set {at}name=vllm",
                f"{at}mode",
            )
        if self.mode != "server":
            because, fix = f"'{at}mode' is '{self.mode}'", f"set {at}mode=server"
            refuse_unset(self.server, f"{at}server.", because, fix)
            why = f"{because} (the colocated engine's agent loop is turn-synchronous)"
            refuse_unset(self, at, why, fix, ["max_concurrent_trajectories"])
