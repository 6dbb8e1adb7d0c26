"""Supervised warm start: teacher-forced cross-entropy on demonstrations, stopped on accuracy.

The demonstrations are a batch of the RL batch's layout and train on the trainer's
``TrainableEngine`` with the ``nll`` loss term (``otbrl.algos.loss_terms.build_sft_loss``): one
training loop. SFT accuracy on a fresh tiny model jumps abruptly (NOTES: ~0.1 to ~0.8 within
~100 steps), so the stopping rule is a greedy validation-accuracy target, not a step count.
Greedy evaluation costs about as much as ten training steps, so it runs when the (free) sure
accuracy of the recent training batches (rows whose every token has probability > 1/2) says the
target is near, plus every ``eval_every`` steps.
``ensure_warm_start`` wraps build → SFT → save in a cache keyed by the settings, so the demo
pays for it once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import otbrl
from otbrl.algos.loss_terms import build_sft_loss
from otbrl.config.schema import SFTConfig
from otbrl.data import get_task, render_prompts
from otbrl.engine.optim import OptimConfig
from otbrl.engine.spec import EngineSpec, MicroBatchConfig
from otbrl.engine.trainable import TrainableEngine
from otbrl.envs.builtin import BUILTIN_ENVS
from otbrl.models import build_tiny_model, eos_token_ids, load_model_and_tokenizer
from otbrl.rollout import HFRollout, SamplingParams, make_agent
from otbrl.rollout.agent import Trajectory
from otbrl.rollout.batch import completions_to_batch, left_pad
from otbrl.rollout.config import MultiTurnConfig
from otbrl.rollout.protocol import Completion
from otbrl.run.evaluate import evaluate_accuracy
from otbrl.settings import check_settings
from otbrl.store.files import apply_umask, atomic_write_text, lock_file
from otbrl.tools import resolve_tools

logger = logging.getLogger(__name__)
WARM_START_FILE = "warm_start.json"


def demonstration_batch(
    rows: Sequence[dict],
    demonstrations: Sequence[str | list[dict]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    turns=None,
) -> dict[str, torch.Tensor]:
    """N demonstrations as a training batch of the RL batch's layout (``completions_to_batch``):
    each prompt (chat template, generation prompt on; left-padded) with its demonstration as the
    response (right-padded) — a response text + EOS, or (tool tasks) a list of turns, assistant
    messages and the tool messages answering them, encoded by ``turns`` (an
    ``otbrl.tools.ChatTurns``) exactly as the agent loop builds a multi-turn response:
    observation tokens are in the sequence (the model attends to them) but not trained.

    Returns ``prompts`` [N, Lp], ``responses`` [N, Lr], ``response_mask`` [N, Lr] (1 on the
    trained tokens, EOS included; 0 on observations and padding), ``input_ids`` /
    ``attention_mask`` / ``position_ids`` [N, Lp + Lr] and the other keys of
    ``completions_to_batch``.
    """
    if len(rows) != len(demonstrations):
        raise ValueError(
            f"demonstrations: expected {len(rows)} (one per row), got {len(demonstrations)}"
        )
    if not rows:
        raise ValueError("rows: expected at least one row, got none")
    eos = _eos_id(tokenizer)
    prompts = tokenizer(render_prompts(rows, tokenizer), add_special_tokens=False)["input_ids"]
    completions = []
    for demo in demonstrations:
        if isinstance(demo, str):
            ids = [*tokenizer(demo, add_special_tokens=False)["input_ids"], eos]
            completions.append([Completion(ids, [0.0] * len(ids), "stop")])
        elif turns is None:
            raise ValueError("turns: a multi-turn demonstration needs the ChatTurns to encode it")
        else:
            ids, mask = turns.conversation_ids(demo)
            completions.append([Trajectory(ids, [0.0] * len(ids), "stop", mask=mask)])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompt_ids, prompt_mask = left_pad(prompts, pad)
    return completions_to_batch(prompt_ids, prompt_mask, completions, pad_id=pad)


def _rows(batch: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``idx`` of ``batch`` without the columns that are padding in all of them (the
    prompts' leading ones, the responses' trailing ones)."""
    picked = {k: v[idx] for k, v in batch.items()}
    width = picked["prompts"].shape[1]
    real = picked["attention_mask"].any(dim=0).nonzero().squeeze(1)
    first = min(int(real[0]), width - 1)  # keep at least one prompt column
    last = max(int(real[-1]) + 1, width + 1)  # and one response column
    out = {}
    for key, value in picked.items():
        if key == "prompts":
            out[key] = value[:, first:]
        elif key in ("input_ids", "attention_mask", "position_ids"):
            out[key] = value[:, first:last]
        elif value.dim() == 2 and value.shape[1] == batch["responses"].shape[1]:
            out[key] = value[:, : last - width]
        else:
            out[key] = value
    return out


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer: expected an EOS token to end demonstrations, got none")
    return int(tokenizer.eos_token_id)


def run_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    demonstrations: Sequence[str],
    settings: SFTConfig | None = None,
    *,
    eval_rows: Sequence[dict] | None = None,
    max_new_tokens: int = 8,
    seed: int = 0,
    trigger_window: int = 5,
    progress: bool = False,
    tools: dict | None = None,
    env=None,
    max_turns: int = 4,
) -> dict:
    """Teacher-forced SFT on response tokens only, on the trainer's ``TrainableEngine`` with the
    ``nll`` loss term; stops at the target accuracy.

    Args:
        rows / demonstrations: N prompts (schema rows) and their target response texts.
        settings: ``sft.*`` (default ``SFTConfig()``): AdamW's ``lr`` after ``warmup_steps``
            of linear warmup, the gradient-norm clip ``grad_clip``, ``batch_size`` sequences
            per step (sampled with replacement from a ``seed``-ed generator), at most
            ``max_steps`` steps; with ``eval_rows``, a greedy evaluation every ``eval_every``
            steps and a stop as soon as it reaches ``target_accuracy`` (without them:
            ``max_steps`` steps, no evaluation). Between the periodic evaluations, one also
            runs as soon as the sure accuracy (below) of the last ``trigger_window`` training
            batches reaches the target (at most every ``trigger_window`` steps).
        max_new_tokens: response cap when evaluating.
        progress: show a progress bar (stderr) with the loss and the last greedy accuracy.
        tools / env: ``{name: Tool}`` for a tool task, or an environment factory
            (``make(row) -> env``) for an environment's task: multi-turn demonstrations are
            encoded as the agent loop builds responses, and greedy evaluation runs the agent
            loop (at most ``max_turns`` model turns) with these tools or this environment.

    The ``nll`` term's ``sft/sure_frac`` is free (from the training forward's own log-probs):
    the share of rows whose every trained token, EOS included, has probability > 1/2 given the
    true prefix — rows greedy decoding answers exactly, so it never overstates the greedy
    accuracy. It lets the accuracy jump be caught within a few steps without paying for a
    greedy evaluation every few steps.

    Returns:
        ``{"steps", "accuracy" (last evaluation, None if never), "reached_target",
        "losses" and "train_accuracies" (``sft/sure_frac``, per step), "evaluations" ([step,
        accuracy] pairs), "seconds"}``.

    Raises ``ConfigError`` naming the ``sft`` key when a setting is out of its range.
    """
    settings = settings or SFTConfig()
    check_settings(settings, "sft.")
    if not isinstance(trigger_window, int) or trigger_window < 1:
        raise ValueError(f"trigger_window: expected an int ≥ 1, got {trigger_window!r}")
    stops = eos_token_ids(model, tokenizer)
    agent = None
    if tools or env is not None:
        agent = _agent(model, tokenizer, tools, env, max_turns, stops)
    data = demonstration_batch(
        rows, demonstrations, tokenizer, turns=agent.turns if agent else None
    )
    engine = _sft_engine(model, settings, seed)
    loss = build_sft_loss()
    evaluate = None
    if eval_rows:
        evaluate = _greedy_evaluation(model, tokenizer, agent, eval_rows, max_new_tokens, stops)
    start_time = time.perf_counter()
    was_training = model.training
    result = _train_until_target(
        engine, loss, data, settings, evaluate, seed=seed, trigger_window=trigger_window,
        progress=progress,
    )  # fmt: skip
    model.train(was_training)
    result["seconds"] = time.perf_counter() - start_time
    return result


def _agent(model, tokenizer, tools: dict | None, env, max_turns: int, stops):
    """The agent loop over the model (``HFRollout``) with ``tools`` or the environment ``env``:
    its ``turns`` encode multi-turn demonstrations as the loop builds responses, and it
    answers greedy evaluation."""
    return make_agent(
        HFRollout(model, tokenizer),
        tokenizer,
        tools,
        MultiTurnConfig(max_turns=max_turns),
        eos_token_ids=stops,
        env=env,
    )


def _sft_engine(model: PreTrainedModel, settings: SFTConfig, seed: int) -> TrainableEngine:
    """The trainer's engine on ``model``: one optimizer step per batch, no weight decay."""
    optim = OptimConfig(
        lr=settings.lr, warmup_steps=settings.warmup_steps, weight_decay=0.0, ppo_epochs=1,
        grad_clip=settings.grad_clip,
    )  # fmt: skip
    spec = EngineSpec(micro=MicroBatchConfig(micro_batch_size=settings.batch_size))
    return TrainableEngine(model, optim, spec, name="sft", seed=seed)


def _greedy_evaluation(model, tokenizer, agent, eval_rows, max_new_tokens: int, stops):
    """A call answering the greedy accuracy on ``eval_rows`` (responses of at most
    ``max_new_tokens``), sampled by ``agent`` for a tool task, else by the model itself."""

    def evaluate() -> float:
        return evaluate_accuracy(
            agent or HFRollout(model, tokenizer),
            tokenizer,
            eval_rows,
            SamplingParams(max_tokens=max_new_tokens, stop_token_ids=tuple(stops), greedy=True),
        )

    return evaluate


def _train_until_target(
    engine: TrainableEngine,
    loss,
    data: dict,
    settings: SFTConfig,
    evaluate,
    *,
    seed,
    trigger_window,
    progress,
) -> dict:
    """The SFT loop: each step trains ``settings.batch_size`` rows of ``data`` (the
    demonstration batch, N rows: prompts [N, Lp], responses [N, Lr], ...) drawn with
    replacement (a ``seed``-ed generator); ``evaluate()`` (None: never) runs every
    ``eval_every`` steps, at the last step, and (at most every ``trigger_window`` steps) when
    the mean sure accuracy of the last ``trigger_window`` steps reaches the target; the loop
    stops at the first evaluation that reaches it. Returns ``run_sft``'s result without
    ``seconds``."""
    target_accuracy = settings.target_accuracy if evaluate else None
    max_steps, eval_every, batch_size = settings.max_steps, settings.eval_every, settings.batch_size
    n = data["input_ids"].shape[0]
    generator = torch.Generator().manual_seed(seed)
    result = {
        "steps": 0,
        "accuracy": None,
        "reached_target": False,
        "losses": [],
        "train_accuracies": [],
        "evaluations": [],
    }
    last_eval = 0
    bar = _progress_bar(max_steps, progress)
    for step in range(1, max_steps + 1):
        idx = torch.randint(n, (batch_size,), generator=generator)
        metrics = engine.update(_rows(data, idx), loss)
        result["losses"].append(metrics["sft/loss"])
        result["train_accuracies"].append(metrics["sft/sure_frac"])
        result["steps"] = step
        recent = result["train_accuracies"][-trigger_window:]
        triggered = (
            target_accuracy is not None
            and len(recent) == trigger_window
            and sum(recent) / trigger_window >= target_accuracy
            and step - last_eval >= trigger_window
        )
        if evaluate and (step % eval_every == 0 or step == max_steps or triggered):
            last_eval = step
            accuracy = evaluate()
            result["accuracy"] = accuracy
            result["evaluations"].append([step, accuracy])
            bar.set_postfix(loss=f"{result['losses'][-1]:.3f}", greedy_acc=f"{accuracy:.3f}")
            if target_accuracy is not None and accuracy >= target_accuracy:
                result["reached_target"] = True
                break
        bar.update(1)
    bar.close()
    return result


def _progress_bar(max_steps: int, progress: bool) -> tqdm:
    """The warm start's bar on stderr (off unless ``progress``): loss and greedy accuracy."""
    return tqdm(
        total=max_steps,
        desc="warm start (SFT)",
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        disable=not progress,
        mininterval=0.5 if sys.stderr.isatty() else 10.0,
    )


def warm_start_key(settings: dict) -> str:
    """Cache key of a warm start: a hash of its settings and the otbrl version."""
    blob = json.dumps({"otbrl": otbrl.__version__, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_warm_start(
    cache_dir: str | Path,
    settings: SFTConfig | None = None,
    *,
    task: str = "arithmetic",
    seed: int = 0,
    arch: str = "llama",
    size: dict | None = None,
    n_eval: int = 500,
    n_train: int | None = None,
) -> Path:
    """Path of a tiny model SFT-ed on ``task`` with ``settings`` (``sft.*``, default
    ``SFTConfig()``; its ``cache_dir`` is not read: ``cache_dir`` is): cached, built if missing.

    The directory (HF layout plus ``warm_start.json`` with the settings and SFT result) is
    ``cache_dir/<task>-<key>``, ``key`` hashing every setting; it is written under a temp name
    and renamed, so it is complete or absent. Evaluation uses ``n_eval`` rows of the task's
    ``val`` split (the split RL validates on); SFT trains on ``n_train`` rows of the ``train``
    split (all of it when ``None``).
    """
    sft = settings or SFTConfig()
    settings = {
        "task": task,
        "seed": seed,
        "arch": arch,
        "size": dict(size or {}),
        **dataclasses.asdict(sft),
        "n_eval": n_eval,
        "n_train": n_train,
    }
    del settings["cache_dir"]  # where the model is kept changes no weight
    cache_dir = Path(cache_dir)
    final = cache_dir / f"{task}-{warm_start_key(settings)}"
    if (final / WARM_START_FILE).is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Parallel runs (e.g. `otbrl compare` arms in separate processes) wait for the first one's
    # warm start instead of each training the same model.
    with _exclusive(cache_dir / f".{final.name}.lock"):
        if (final / WARM_START_FILE).is_file():
            return final
        _remove_stale_temps(cache_dir, final.name)
        logger.info(
            "warm start: SFT of the built-in model to greedy accuracy %s", sft.target_accuracy
        )
        _build_warm_start(cache_dir / f".tmp-{final.name}-{os.getpid()}", final, settings, sft)
    return final


def _build_warm_start(tmp: Path, final: Path, settings: dict, sft: SFTConfig) -> None:
    task_obj = get_task(settings["task"])
    seed = settings["seed"]
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(
        tmp, task=settings["task"], arch=settings["arch"], seed=seed, **settings["size"]
    )
    model, tokenizer = load_model_and_tokenizer(tmp)
    rows = task_obj.rows("train", settings["n_train"], seed=seed)
    with torch.random.fork_rng(devices=[]):
        result = run_sft(
            model,
            tokenizer,
            rows,
            [task_obj.demonstration(r) for r in rows],
            sft,
            eval_rows=task_obj.rows("val", settings["n_eval"], seed=seed),
            max_new_tokens=task_obj.max_response_chars + 1,
            seed=seed,
            progress=True,
            tools=resolve_tools(task_obj.tools) if task_obj.tools else None,
            env=BUILTIN_ENVS[task_obj.env] if task_obj.env else None,
            max_turns=task_obj.max_turns,
        )
    if not result["reached_target"]:
        logger.warning(
            "warm start stopped at max_steps=%d with accuracy %s < target %s",
            settings["max_steps"],
            result["accuracy"],
            settings["target_accuracy"],
        )
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    summary = {k: v for k, v in result.items() if k not in ("losses", "train_accuracies")}
    summary["final_loss"] = result["losses"][-1]
    _write_json(tmp / WARM_START_FILE, {"settings": settings, "result": summary})
    apply_umask(tmp)  # save_pretrained's safetensors are 0600: a shared cache could not read them
    try:
        os.rename(tmp, final)
    except OSError:
        # A process without the lock (another cache on a filesystem without flock) finished
        # the same warm start first; theirs is equally valid.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / WARM_START_FILE).is_file():
            raise


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An advisory ``flock`` held for the block (waiting for it); released by the OS if the
    process dies."""
    fd = lock_file(lock_path, wait=True)
    try:
        yield
    finally:
        os.close(fd)


def _remove_stale_temps(cache_dir: Path, name: str) -> None:
    """Delete ``.tmp-<name>-<pid>`` directories left by killed builds (their pid is gone)."""
    for tmp in cache_dir.glob(f".tmp-{name}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: Path, obj: dict) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2))
