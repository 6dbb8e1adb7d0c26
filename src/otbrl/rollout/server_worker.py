"""The worker extension a vLLM server loads (``--worker-extension-cls
otbrl.rollout.server_worker.WeightLoader``) so otbrl can push weights into it on CPU.

vLLM's weight-transfer engines (NCCL, IPC) are GPU ones; here the trainer writes the weights as
safetensors buckets with a manifest (``otbrl.rollout.weight_buckets``) and calls, through the
dev-mode ``/collective_rpc`` endpoint (JSON arguments only), ``otbrl_load_weights(manifest,
...)``: the worker reads each bucket from the trainer's directory (``directory``: one machine,
or a shared file system) or fetches it from the trainer's ``WeightServer`` (``url`` and
``token``: no shared file system), checks it against the manifest (size, SHA-256, tensor count)
before any of its tensors loads, streams the buckets in order into one ``reload_weights`` pass
(the same in-place reload the in-process backend uses), repacks a tied lm_head on CPU and
returns the tensor count, which the trainer checks, with what the worker now holds (``loaded``:
the run's id and the weights version it was given). ``otbrl_loaded()`` reports that before the
next update: a server restarted behind the trainer's back (its step-0 weights) or loaded by
another run says so, instead of sampling for this one. ``otbrl_progress()`` reports how many
tokens each in-flight request has generated (partial rollouts: where a weight update falls
inside a completion). The extension imports only torch and safetensors at call time.
"""

from __future__ import annotations

from otbrl.rollout.weight_buckets import checked_buckets, read_file, read_http


class WeightLoader:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``: its methods become
    ``collective_rpc`` targets."""

    def otbrl_load_weights(
        self,
        manifest: list,
        directory: str | None = None,
        url: str | None = None,
        token: str | None = None,
        timeout: float = 300.0,
        loaded: str = "",
    ) -> str:
        """Load every bucket of ``manifest`` (HF names) in place, from ``directory`` or from
        the ``WeightServer`` at ``url`` (with its ``token``), each checked first; returns
        ``"<tensor count> <loaded>"`` (``loaded``: the run id and version the trainer gave,
        kept for ``otbrl_loaded``)."""
        from vllm.platforms import current_platform

        from otbrl.rollout.vllm_common import repack_tied_lm_head, tied_lm_head

        if (directory is None) == (url is None):
            raise ValueError("otbrl_load_weights: expected a directory or a url, not both")
        read = read_file(directory) if url is None else read_http(url, token or "", timeout)
        count = 0

        def counted():
            nonlocal count
            for item in checked_buckets(manifest, read, f"weights from {directory or url}"):
                count += 1
                yield item

        self._otbrl_loaded = "partial"  # a load that fails part-way leaves mixed weights
        self.reload_weights(weights_iterator=counted())
        if current_platform.is_cpu() and tied_lm_head(self) is not None:
            repack_tied_lm_head(self)
        self._otbrl_loaded = loaded
        return f"{count} {loaded}".strip()

    def otbrl_loaded(self) -> str:
        """What the last complete ``otbrl_load_weights`` was given (``"none"``: the weights
        the server started with; ``"partial"``: a load that failed part-way)."""
        return getattr(self, "_otbrl_loaded", "none")

    def otbrl_progress(self) -> dict[str, int]:
        """Tokens generated so far by every request this worker holds, by vLLM's internal
        request id (partial rollouts: read while the server is paused, so exact)."""
        requests = getattr(self.model_runner, "requests", {})
        return {
            rid: sum(1 for t in state.output_token_ids if t >= 0) for rid, state in requests.items()
        }
