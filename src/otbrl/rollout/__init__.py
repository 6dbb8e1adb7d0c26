"""otbrl.rollout: response generation (HF ``generate`` on CPU)."""

from otbrl.rollout.hf import decode_responses, eos_response_mask, generate

__all__ = ["decode_responses", "eos_response_mask", "generate"]
