"""otbrl.rollout: one protocol, two backends (HF in-process sampler, vLLM), weight sync, and
the agent loop (multi-turn tool use) over either.

``VLLMRollout`` imports vLLM only when an engine is built; ``check_vllm_installed`` imports
nothing, so config validation can call it cheaply.
"""

from otbrl.rollout.agent import AgentLoop, Trajectory, make_agent, tool_metrics, transcript_rows
from otbrl.rollout.base import (
    FINISH_REASONS,
    Completion,
    RolloutEngine,
    SamplingParams,
    completions_to_batch,
    left_pad,
    unpad_prompts,
)
from otbrl.rollout.hf import (
    decode_responses,
    decode_transcripts,
    eos_response_mask,
    final_turn_span,
    generate,
    sample_next_token,
)
from otbrl.rollout.hf_engine import HFRollout
from otbrl.rollout.vllm_engine import INSTALL_HINT, VLLMRollout, check_vllm_installed

__all__ = [
    "FINISH_REASONS",
    "INSTALL_HINT",
    "AgentLoop",
    "Completion",
    "HFRollout",
    "RolloutEngine",
    "SamplingParams",
    "Trajectory",
    "VLLMRollout",
    "check_vllm_installed",
    "completions_to_batch",
    "decode_responses",
    "decode_transcripts",
    "eos_response_mask",
    "final_turn_span",
    "generate",
    "left_pad",
    "make_agent",
    "sample_next_token",
    "tool_metrics",
    "transcript_rows",
    "unpad_prompts",
]
