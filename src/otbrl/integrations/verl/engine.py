"""Let verl's FSDP engine return Σπ² when the fused kernels are on.

``FSDPEngineWithLMHead.prepare_model_outputs`` raises ``NotImplementedError`` for
``calculate_sum_pi_squared=True`` with ``use_fused_kernels=True`` because verl's fused
forwards never hold the logits. With ``impl_backend=otbrl`` the model output already carries
``sum_pi_squared`` (:mod:`.fused_forward`); the wrapper below runs verl's own output handling
for log-probs and entropy and lays Σπ² out exactly like them: packed ``[1, nnz]`` output,
Ulysses gather and static-pad removal through the engine's ``_gather_and_unpad_packed``, then
a jagged nested tensor on the micro-batch's ``cu_seqlens``. Other layouts raise a clear error.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("otbrl.integrations.verl")


def _wrap(original):
    from verl.utils import tensordict_utils as tu

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        want = tu.get_non_tensor_data(micro_batch, key="calculate_sum_pi_squared", default=False)
        fused = tu.get_non_tensor_data(micro_batch, key="use_fused_kernels", default=False)
        if not (want and fused):
            return original(self, output, output_args, micro_batch, logits_processor_func)
        spp = getattr(output, "sum_pi_squared", None)
        if spp is None:
            raise NotImplementedError(
                "calculate_sum_pi_squared=True with use_fused_kernels=True needs the fused forward "
                "that returns Σπ²: set actor_rollout_ref.model.fused_kernel_options."
                "impl_backend=otbrl"
            )
        packed = tu.get_non_tensor_data(micro_batch, key="use_remove_padding", default=True)
        if not packed:
            raise NotImplementedError(
                "Σπ² on the fused path is implemented for packed batches: set "
                "actor_rollout_ref.model.use_remove_padding=True (got False)"
            )
        # verl's own handling of everything else, with its Σπ² branch (which would raise) off;
        # a shallow copy so the caller's micro-batch keeps its flags.
        quiet = micro_batch.copy()
        tu.assign_non_tensor(quiet, calculate_sum_pi_squared=False)
        model_output = original(self, output, output_args, quiet, logits_processor_func)
        values = self._gather_and_unpad_packed(spp.squeeze(0), output_args["pad_size"])
        cu_seqlens = micro_batch["input_ids"].offsets()
        model_output["sum_pi_squared"] = torch.nested.nested_tensor_from_jagged(values, cu_seqlens)
        return model_output

    prepare_model_outputs._otbrl_original = original
    return prepare_model_outputs


def install_engine_patch() -> bool:
    """Wrap ``FSDPEngineWithLMHead.prepare_model_outputs`` (the critic's value-head engine,
    a subclass with its own method, is untouched); idempotent. Returns True."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    current = FSDPEngineWithLMHead.__dict__["prepare_model_outputs"]
    if getattr(current, "_otbrl_original", None) is None:
        FSDPEngineWithLMHead.prepare_model_outputs = _wrap(current)
        logger.info("otbrl: FSDP engine returns Σπ² with use_fused_kernels=True")
    return True
