"""otbrl.rollout: one protocol, two backends (HF in-process sampler, vLLM), weight sync.

``VLLMRollout`` imports vLLM only when an engine is built; ``check_vllm_installed`` imports
nothing, so config validation can call it cheaply.
"""

from otbrl.rollout.base import (
    FINISH_REASONS,
    Completion,
    RolloutEngine,
    SamplingParams,
    completions_to_batch,
    left_pad,
    unpad_prompts,
)
from otbrl.rollout.hf import decode_responses, eos_response_mask, generate, sample_next_token
from otbrl.rollout.hf_engine import HFRollout
from otbrl.rollout.vllm_engine import INSTALL_HINT, VLLMRollout, check_vllm_installed

__all__ = [
    "FINISH_REASONS",
    "INSTALL_HINT",
    "Completion",
    "HFRollout",
    "RolloutEngine",
    "SamplingParams",
    "VLLMRollout",
    "check_vllm_installed",
    "completions_to_batch",
    "decode_responses",
    "eos_response_mask",
    "generate",
    "left_pad",
    "sample_next_token",
    "unpad_prompts",
]
