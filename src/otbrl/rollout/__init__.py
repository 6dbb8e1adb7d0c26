"""otbrl.rollout (floor 3): the protocol (``protocol``: ``SamplingParams``, ``Completion``,
``Sampler`` / ``RolloutBackend``), batch building and decoding (``batch``), three backends (``hf``:
in-process HF sampler; ``vllm``: in-process vLLM; ``server``: vLLM OpenAI servers) with weight
sync (``sync``: what a backend is sent after an update), and the agent loop (``agent``:
multi-turn episodes of an environment, the tool loop among them; ``episode``: one sample's)
over any of them. The two vLLM
backends share ``vllm_common``; the server backend's jobs beside orchestration live in
``server_process`` (processes), ``server_client`` (HTTP), ``weight_buckets`` (weight files, read
by the servers' ``server_worker``) and ``partial`` (versions per token).

``VLLMRollout`` imports vLLM only when an engine is built; ``check_vllm_installed`` imports
nothing, so config validation can call it cheaply.
"""

from otbrl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "agent": (
            "AgentLoop",
            "make_agent",
            "tool_metrics",
            "transcript_rows",
        ),
        "batch": (
            "completions_to_batch",
            "decode_responses",
            "decode_transcripts",
            "final_turn_span",
            "left_pad",
            "unpad_prompts",
        ),
        "episode": ("Episode", "Trajectory"),
        "hf": (
            "HFRollout",
            "sample_next_token",
        ),
        "protocol": (
            "FINISH_REASONS",
            "Completion",
            "RolloutBackend",
            "Sampler",
            "SamplingParams",
        ),
        "server": (
            "ServerError",
            "ServerRollout",
        ),
        "sync": ("sync_from",),
        "vllm": ("VLLMRollout",),
        "vllm_common": (
            "INSTALL_HINT",
            "check_vllm_installed",
        ),
    },
)
