"""otbrl.rollout: response generation with HF causal LMs on CPU (or one device)."""

from otbrl.rollout.hf import decode_responses, eos_response_mask, generate, sample_next_token

__all__ = ["decode_responses", "eos_response_mask", "generate", "sample_next_token"]
