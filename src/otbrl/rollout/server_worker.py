"""The worker extension a vLLM server loads (``--worker-extension-cls
otbrl.rollout.server_worker.WeightLoader``) so otbrl can push weights into it on CPU.

vLLM's weight-transfer engines (NCCL, IPC) are GPU ones; here the trainer writes the weights as
safetensors buckets (``otbrl.rollout.weight_buckets``) into a directory both sides see
(``/dev/shm`` on one machine) and calls, through the dev-mode ``/collective_rpc`` endpoint (string
arguments only), ``otbrl_load_weights(directory)``: the worker streams the buckets, in their file
order, into one ``reload_weights`` pass (the same in-place reload the in-process backend uses) and
repacks a tied lm_head on CPU. ``otbrl_progress()`` reports how many tokens each in-flight request
has generated (partial rollouts: where a weight update falls inside a completion). The extension
imports only torch and safetensors at call time.
"""

from __future__ import annotations

from otbrl.rollout.weight_buckets import iter_buckets


class WeightLoader:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``: its methods become
    ``collective_rpc`` targets."""

    def otbrl_load_weights(self, directory: str) -> int:
        """Load every bucket of ``directory`` (HF names) in place; returns the tensor count."""
        from vllm.platforms import current_platform

        from otbrl.rollout.vllm_common import repack_tied_lm_head, tied_lm_head

        count = 0

        def counted():
            nonlocal count
            for item in iter_buckets(directory):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted())
        if current_platform.is_cpu() and tied_lm_head(self) is not None:
            repack_tied_lm_head(self)
        return count

    def otbrl_progress(self) -> dict[str, int]:
        """Tokens generated so far by every request this worker holds, by vLLM's internal
        request id (partial rollouts: read while the server is paused, so exact)."""
        requests = getattr(self.model_runner, "requests", {})
        return {
            rid: sum(1 for t in state.output_token_ids if t >= 0) for rid, state in requests.items()
        }
