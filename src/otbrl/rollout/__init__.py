"""otbrl.rollout (floor 3): the protocol (``protocol``: ``SamplingParams``, ``Completion``,
``Sampler`` / ``RolloutBackend``), batch building and decoding (``batch``), three backends (``hf``:
in-process HF sampler; ``vllm``: in-process vLLM; ``server``: vLLM OpenAI servers) with weight
sync, and the agent loop (``agent``: multi-turn tool use) over any of them. The two vLLM
backends share ``vllm_common``; the server backend's jobs beside orchestration live in
``server_process`` (processes), ``server_client`` (HTTP), ``weight_buckets`` (weight files, read
by the servers' ``server_worker``) and ``partial`` (versions per token).

``VLLMRollout`` imports vLLM only when an engine is built; ``check_vllm_installed`` imports
nothing, so config validation can call it cheaply.
"""

from otbrl.rollout.agent import AgentLoop, Trajectory, make_agent, tool_metrics, transcript_rows
from otbrl.rollout.batch import (
    completions_to_batch,
    decode_responses,
    decode_transcripts,
    final_turn_span,
    left_pad,
    unpad_prompts,
)
from otbrl.rollout.hf import HFRollout, sample_next_token
from otbrl.rollout.protocol import (
    FINISH_REASONS,
    Completion,
    RolloutBackend,
    Sampler,
    SamplingParams,
)
from otbrl.rollout.server import ServerError, ServerRollout
from otbrl.rollout.vllm import VLLMRollout
from otbrl.rollout.vllm_common import INSTALL_HINT, check_vllm_installed

__all__ = [
    "FINISH_REASONS",
    "INSTALL_HINT",
    "AgentLoop",
    "Completion",
    "HFRollout",
    "RolloutBackend",
    "Sampler",
    "SamplingParams",
    "ServerError",
    "ServerRollout",
    "Trajectory",
    "VLLMRollout",
    "check_vllm_installed",
    "completions_to_batch",
    "decode_responses",
    "decode_transcripts",
    "final_turn_span",
    "left_pad",
    "make_agent",
    "sample_next_token",
    "tool_metrics",
    "transcript_rows",
    "unpad_prompts",
]
