"""What a run says on stderr (rank 0): its start-up lines, and what an interruption kept."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from otbrl.config.schema import TrainerConfig
from otbrl.store import checkpoint


def say(text: str) -> None:
    """One ``otbrl: ...`` line on stderr."""
    print(f"otbrl: {text}", file=sys.stderr, flush=True)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def engine_bytes(engine) -> int:
    """Bytes one checkpoint holds for ``engine``, as ``otbrl.store.checkpoint`` writes it: the
    model's weights, each tied parameter once (a LoRA model: its adapter alone, the frozen base
    is ``model.path``), and AdamW's two moments of every parameter the optimizer trains (same
    dtype as it), at full (unsharded) size. Shapes only: no collective (rank 0 alone asks)."""

    def size(p) -> int:
        return p.numel() * p.element_size()

    adapter_only = engine.lora is not None
    weights = sum(
        size(p) for name, p in engine.model.named_parameters()
        if not adapter_only or ".lora_" in name
    )  # fmt: skip
    trained = {id(p): p for group in engine.optimizer.param_groups for p in group["params"]}
    return weights + 2 * sum(size(p) for p in trained.values())


def startup_lines(
    t: TrainerConfig,
    *,
    notes: Sequence[str],
    engines: Iterable,
    ckpt_root: Path,
    output_dir: Path,
    step: int,
) -> list[str]:
    """What the plan changed in the data (``notes``), the disk the checkpoints of ``engines``
    will take under the ``trainer`` settings ``t``, and a run that is already complete."""
    lines = list(notes)
    if t.save_every > 0:
        lines.append(_checkpoint_line(t, sum(engine_bytes(e) for e in engines), ckpt_root))
    else:
        lines.append("no checkpoints (trainer.save_every=0): an interrupted run starts over")
    if step >= t.total_steps:
        lines.append(
            f"the run in {output_dir} is already complete (step {step} of "
            f"trainer.total_steps={t.total_steps}): nothing to train; raise "
            "trainer.total_steps to train on, or use a new trainer.output_dir"
        )
    return lines


def _checkpoint_line(t: TrainerConfig, size: float, ckpt_root: Path) -> str:
    """When the checkpoints come, how many are kept and the disk they take (``size``: one's)."""
    # every save_every-th step, and the last step when it is not one of them
    saves = -(-t.total_steps // t.save_every)
    if saves == 1:
        return (
            f"one checkpoint, at the end of the run (step {t.total_steps}; "
            f"trainer.save_every={t.save_every}): ~{_gb(size)}"
        )
    kept = min(saves, t.keep_last_checkpoints or saves)
    retention = (
        f"the newest {kept} kept (trainer.keep_last_checkpoints)"
        if t.keep_last_checkpoints
        else "all kept (trainer.keep_last_checkpoints=0)"
    )
    every = "every step" if t.save_every == 1 else f"every {t.save_every} steps"
    return (
        f"checkpoints {every}, {retention}: ~{_gb(size)} each, "
        f"up to ~{_gb(size * min(kept + 1, saves))} in {ckpt_root} while one is written"
    )


def interrupted_line(ckpt_root: Path, output_dir: Path, step: int) -> str:
    """Ctrl-C at ``step``: what of the run is kept, and what the same command will do."""
    newest = checkpoint.latest_checkpoint(ckpt_root)
    if newest is not None:
        kept = (
            f"the newest checkpoint is {newest.name}: the same command resumes from "
            f"step {checkpoint.checkpoint_step(newest)}"
        )
    else:
        kept = (
            "no checkpoint was written (trainer.save_every), so the same command starts "
            f"over; the metrics so far are in {output_dir / 'metrics.jsonl'}"
        )
    return f"interrupted at step {step}: {kept}"
