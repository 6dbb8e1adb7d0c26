"""A fused lm_head forward for verl that also returns Σπ² (``impl_backend=otbrl``).

verl picks the fused forward of a model in ``monkey_patch.patch_forward_with_backends`` from
``fused_kernel_options.impl_backend``; its dense forwards return log-probs and entropy only.
This one runs the decoder body with verl's own ``forward_base_model`` and the lm_head through
``otbrl.ops.fused_linear_token_stats``: log π(y), entropy and Σπ² in one chunked pass, the
``[T, V]`` logits never held. Dense text models only (vision-language models have their own
forwards in verl and are refused with an error).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from otbrl.ops import fused_linear_token_stats

logger = logging.getLogger("otbrl.integrations.verl")

BACKEND = "otbrl"
# verl routes these model types to forwards of their own (vision towers, 3-D positions).
_VLM_TYPES = (
    "qwen2_5_vl",
    "qwen2_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "glm4v",
    "qwen3_5",
    "qwen3_5_moe",
)


def _output_class():
    from verl.models.transformers.dense_common import CausalLMOutputForPPO

    @dataclass
    class CausalLMOutputWithSumPiSquared(CausalLMOutputForPPO):
        """verl's PPO output plus ``sum_pi_squared`` (same shape as ``log_probs``, no grad)."""

        sum_pi_squared: torch.FloatTensor | None = None

    return CausalLMOutputWithSumPiSquared


_OUTPUT_CLASS = None


def forward_with_otbrl_backend(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.FloatTensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_attentions: bool | None = None,
    output_hidden_states: bool | None = None,
    return_dict: bool | None = None,
    cache_position: torch.LongTensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    temperature: float = 1.0,
    shift_labels: torch.LongTensor | None = None,
    **loss_kwargs,
):
    """verl's fused-forward signature; returns ``log_probs``, ``entropy`` and ``sum_pi_squared``.

    Shapes: ``input_ids`` ``[b, s]`` (``[1, nnz]`` packed) -> each statistic ``[b, s]`` float32,
    the statistic of position t being that of the distribution predicting the label at t
    (``shift_labels``, else ``labels``/``input_ids`` rolled by one, as verl's backends do).
    ``temperature`` is one float (verl's fused path has no per-sample temperature).
    """
    global _OUTPUT_CLASS
    from verl.models.transformers.dense_common import forward_base_model

    if not return_dict:
        raise NotImplementedError("forward_with_otbrl_backend: verl calls it with return_dict=True")
    outputs = forward_base_model(
        self,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_attentions=output_attentions,
        output_hidden_states=output_hidden_states,
        cache_position=cache_position,
    )
    hidden = outputs[0]
    if shift_labels is not None:
        rolled = shift_labels
    elif labels is not None:
        rolled = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise ValueError("forward_with_otbrl_backend: pass input_ids, labels or shift_labels")
    head = self.lm_head
    weight, bias = head.weight, head.bias
    # Forward and backward must run the lm_head in one dtype: outside autocast, hidden cast to
    # the weight's dtype (bf16 under FSDP mixed precision).
    with torch.autocast(hidden.device.type, enabled=False):
        stats = fused_linear_token_stats(
            hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype),
            weight,
            rolled.reshape(-1).long(),
            bias=bias,
            temperature=float(temperature),
        )
    if _OUTPUT_CLASS is None:
        _OUTPUT_CLASS = _output_class()
    shape = rolled.shape
    return _OUTPUT_CLASS(
        log_probs=stats.log_probs.reshape(shape),
        entropy=stats.entropy.reshape(shape),
        sum_pi_squared=stats.sum_pi_squared.reshape(shape),
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


def install_fused_backend() -> bool:
    """Teach ``monkey_patch.patch_forward_with_backends`` the ``otbrl`` backend; idempotent.

    Other backends go to verl's function unchanged. Returns True.
    """
    from verl.models.transformers import monkey_patch

    original = monkey_patch.patch_forward_with_backends
    if getattr(original, "_otbrl_original", None) is not None:
        return True

    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None):
        if not (use_fused_kernels and fused_kernels_backend == BACKEND):
            return original(model, use_fused_kernels, fused_kernels_backend)
        model_type = getattr(model.config, "model_type", None)
        if model_type in _VLM_TYPES or hasattr(model.config, "vision_config"):
            raise NotImplementedError(
                f"fused_kernel_options.impl_backend=otbrl covers dense text models; "
                f"{model_type!r} is a vision-language model (use impl_backend=torch)"
            )
        if not hasattr(model, "lm_head") or not hasattr(model, "model"):
            raise NotImplementedError(
                f"impl_backend=otbrl needs a causal LM with .model and .lm_head, "
                f"got {type(model).__name__}"
            )
        model._verl_fused_kernels_backend = BACKEND
        model.__class__.forward = forward_with_otbrl_backend
        logger.info("otbrl: fused forward with Σπ² for %s", type(model).__name__)

    patch_forward_with_backends._otbrl_original = original
    monkey_patch.patch_forward_with_backends = patch_forward_with_backends
    return True
