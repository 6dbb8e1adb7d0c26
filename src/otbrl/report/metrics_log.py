"""Per-step metrics: progress bar, ``metrics.jsonl``, optional TensorBoard / W&B, end summary.

One JSON object per step is appended to ``<output_dir>/metrics.jsonl`` and flushed at once, so a
run killed at any moment leaves every finished step on disk. Resuming from a checkpoint at step
k drops the lines with ``step > k`` (they belong to steps the resumed run will redo), which makes
the file of a resumed run equal to the file of an uninterrupted one.

This module holds the metrics log and the summary; the atomic-write helpers every writer
uses (temp file in the same folder, fsync, rename) live in :mod:`otbrl.store.files`. It imports
no torch, so tools that only read runs start fast.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from tqdm.auto import tqdm

from otbrl.store.files import GENERATIONS_FILE, METRICS_FILE, SUMMARY_FILE, atomic_write_text
from otbrl.store.plain import json_safe, to_number, to_plain_dict

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
# backend -> (module that must be importable, pip extra that provides it)
_OPTIONAL = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}

# (metrics key, short label): shown on the progress bar when present; one line, so only a few.
_BAR_KEYS = (
    ("train/reward_mean", "reward"),
    ("val/accuracy", "val acc"),
    ("policy/entropy_mean", "entropy"),
    ("policy/sum_pi_squared_mean", "Σπ²"),
    ("tool/call_rate", "tool rate"),  # multi-turn runs only
)
# (metrics key, label): the "last value" rows of the end-of-run summary.
_SUMMARY_KEYS = (
    ("train/reward_mean", "last reward mean"),
    ("policy/entropy_mean", "last entropy"),
    ("policy/sum_pi_squared_mean", "last Σπ²"),
    ("policy/grad_norm", "last grad norm"),
)


def check_backends(backends: Iterable[str]) -> tuple[str, ...]:
    """Validate logger backend names and that optional packages are installed, importing nothing.

    Returns the names as a tuple. Raises ``ValueError`` for an unknown name and ``ImportError``
    naming the missing package (and the pip extra) for ``tensorboard`` / ``wandb``. Cheap: call it
    while validating the configuration, before any model is loaded.
    """
    if isinstance(backends, str):
        raise TypeError(
            f"backends: expected a list of names from {BACKENDS}, got a str {backends!r}"
        )
    names = tuple(backends)
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"backends: expected names from {BACKENDS}, got {name!r}")
        if name in _OPTIONAL:
            module, extra = _OPTIONAL[name]
            if importlib.util.find_spec(module) is None:
                raise ImportError(
                    f"logger backend {name!r} needs the '{module}' package, which is not "
                    f"installed: pip install 'otbrl[{extra}]'"
                )
    return names


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Records of ``<run_dir>/metrics.jsonl`` (or of that file path), in file order.

    A line that is not valid JSON (a write torn by a kill) is skipped. Non-finite values appear
    as ``None``. Raises ``ValueError`` when the file does not exist.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"run_dir: expected a run directory containing {METRICS_FILE}, got {path}")
    records, _ = _parse_lines(path.read_bytes())
    return records


def _parse_lines(data: bytes) -> tuple[list[dict[str, Any]], int]:
    records, bad = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            bad += 1
    return records, bad


def _format_duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def _format_value(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _md_cell(value: Any) -> str:
    """One Markdown table cell: pipes escaped, newlines as <br>."""
    return str(value).replace("|", "\\|").replace("\n", "<br>")


class MetricsLogger:
    """Writes one record per training step to every requested backend.

    Args:
        output_dir: run directory (created); holds ``metrics.jsonl`` and ``summary.json``.
        backends: subset of ``("console", "jsonl", "tensorboard", "wandb")``.
        total_steps: length of the progress bar (steps of the whole run, not of this segment).
        config: resolved run configuration (dict, dataclass or OmegaConf), saved as
            ``<output_dir>/config.yaml`` and handed to TensorBoard / W&B.
        initial_step: 0 for a fresh run (an existing ``metrics.jsonl`` is replaced); k > 0 when
            resuming from the checkpoint of step k (lines with ``step > k`` are dropped).
        stream: where the console summary is printed (default ``sys.stdout``); the progress bar
            goes to ``sys.stderr``.

    ``log(step, metrics)`` takes scalars (Python / NumPy numbers, one-element tensors). Logging
    the same step again merges into that step's record (its line is rewritten), so validation
    metrics may arrive after the training metrics of a step. Non-finite values are written as
    ``null``, counted in ``nonfinite_counts`` and warned about once per key.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        backends: Iterable[str] = ("console", "jsonl"),
        total_steps: int,
        config: Any = None,
        initial_step: int = 0,
        stream: TextIO | None = None,
    ) -> None:
        self.backends = check_backends(backends)
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"total_steps: expected an int >= 0, got {total_steps!r}")
        if isinstance(initial_step, bool) or not isinstance(initial_step, int) or initial_step < 0:
            raise ValueError(f"initial_step: expected an int >= 0, got {initial_step!r}")
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.initial_step = initial_step
        self.config = to_plain_dict(config) if config is not None else None
        self.nonfinite_counts: dict[str, int] = {}
        self._stream = stream
        self._start = time.monotonic()
        self._last: dict[str, Any] = {}  # most recent finite value of every key seen
        self._last_step: int | None = None
        self._last_record: dict[str, Any] | None = None
        self._last_offset = 0  # byte offset where the last record's line starts
        self._file = None
        self._bar = None
        self._tb = None
        self._wandb_run = None
        self._closed = False

        try:
            self._start_backends()
        except BaseException:
            self.close()  # a failing backend must not leave the file or the bar open
            raise

    def _start_backends(self) -> None:
        if self.config is not None:
            import yaml  # a dependency of omegaconf

            atomic_write_text(
                self.output_dir / "config.yaml",
                yaml.safe_dump(self.config, sort_keys=False, allow_unicode=True),
            )
        if "jsonl" in self.backends:
            self._open_jsonl()
            self._keep_generations()
        if "console" in self.backends:
            self._bar = tqdm(
                total=self.total_steps,
                initial=min(self.initial_step, self.total_steps),
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                # Redirected to a file, every refresh is another \r-separated copy of the bar.
                mininterval=0.1 if sys.stderr.isatty() else 10.0,
            )
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a killed run wrote past its last checkpoint.
            self._tb = SummaryWriter(
                log_dir=str(self.output_dir / "tensorboard"),
                purge_step=self.initial_step + 1 if self.initial_step > 0 else None,
            )
            if self.config is not None:
                self._tb.add_text("config", f"```\n{json.dumps(self.config, indent=2)}\n```")
        if "wandb" in self.backends:
            wandb = importlib.import_module("wandb")
            self._wandb_run = wandb.init(
                name=self.output_dir.name, dir=str(self.output_dir), config=self.config
            )

    def _open_jsonl(self) -> None:
        path = self.output_dir / METRICS_FILE
        kept: list[dict[str, Any]] = []
        if self.initial_step > 0 and path.exists():
            records, bad = _parse_lines(path.read_bytes())
            if bad:
                warnings.warn(
                    f"{path}: skipped {bad} unreadable line(s) (a write torn by a kill)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            kept = [r for r in records if r["step"] <= self.initial_step]
        lines = [json.dumps(r, allow_nan=False) + "\n" for r in kept]
        # The truncated file replaces the old one atomically: a kill here loses nothing.
        atomic_write_text(path, "".join(lines))
        for record in kept:
            self._remember(record)
        self._file = path.open("ab")
        self._last_offset = self._file.tell() - (len(lines[-1].encode()) if lines else 0)
        if kept:
            self._last_step, self._last_record = kept[-1]["step"], kept[-1]

    def _keep_generations(self) -> None:
        """Resuming at step k: drop the generations of later steps (they will be redone), like
        the metrics; a fresh run starts the file empty."""
        path = self.output_dir / GENERATIONS_FILE
        if not path.exists():
            return
        kept = []
        if self.initial_step > 0:
            records, _ = _parse_lines(path.read_bytes())
            kept = [r for r in records if r.get("step", 0) <= self.initial_step]
        atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))

    def log_generations(self, step: int, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append sampled ``rows`` (``{"prompt", "response", "reward", ...}``, JSON-able) of
        ``step`` to ``generations.jsonl`` (jsonl backend), and as a table to TensorBoard
        (text) and W&B (``wandb.Table``) when those are on."""
        if self._closed:
            raise ValueError("log_generations: this MetricsLogger is closed")
        records = [{"step": step, **json_safe(dict(row))} for row in rows]
        if not records:
            return
        if "jsonl" in self.backends:
            with (self.output_dir / GENERATIONS_FILE).open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        columns = list(dict.fromkeys(k for r in records for k in r))
        if self._tb is not None:
            header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
            body = "".join(
                "| " + " | ".join(_md_cell(r.get(c)) for c in columns) + " |\n" for r in records
            )
            self._tb.add_text("generations", header + body, global_step=step)
            self._tb.flush()
        if self._wandb_run is not None:
            wandb = importlib.import_module("wandb")
            table = wandb.Table(
                columns=columns, data=[[r.get(c) for c in columns] for r in records]
            )
            self._wandb_run.log({"generations": table}, step=step)

    def _remember(self, record: Mapping[str, Any]) -> None:
        for key, value in record.items():
            if key != "step" and value is not None:
                self._last[key] = value

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (key -> scalar) for ``step``; steps must not decrease."""
        if self._closed:
            raise ValueError("log: this MetricsLogger is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics: expected a mapping of str -> number, got {type(metrics)}")
        if self._last_step is not None and step < self._last_step:
            raise ValueError(f"step: expected >= last logged step {self._last_step}, got {step}")

        clean: dict[str, int | float | None] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key or key == "step":
                raise ValueError(
                    f"metrics: keys must be non-empty str other than 'step', got {key!r}"
                )
            number = to_number(key, value)
            if isinstance(number, float) and not math.isfinite(number):
                if key not in self.nonfinite_counts:
                    warnings.warn(
                        f"metric {key!r} is {number} at step {step}; written as null",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                self.nonfinite_counts[key] = self.nonfinite_counts.get(key, 0) + 1
                number = None
            clean[key] = number

        merge = step == self._last_step and self._last_record is not None
        record = {**self._last_record, **clean} if merge else {"step": step, **clean}
        if self._file is not None:
            if merge:
                self._file.truncate(self._last_offset)
                self._file.seek(0, 2)
            else:
                self._last_offset = self._file.tell()
            self._file.write((json.dumps(record, allow_nan=False) + "\n").encode())
            self._file.flush()
        self._last_step, self._last_record = step, record
        self._remember(clean)

        finite = {k: v for k, v in clean.items() if v is not None}
        if self._tb is not None:
            for key, value in finite.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(finite, step=step)
        if self._bar is not None:
            live = [f"{label} {self._last[k]:.3g}" for k, label in _BAR_KEYS if k in self._last]
            self._bar.set_postfix_str(" ".join(live), refresh=False)
            # update() redraws at most every mininterval, so a fast loop does not flood stderr.
            self._bar.update(max(0, min(step, self.total_steps) - self._bar.n))

    def summary(self, final: Mapping[str, Any]) -> dict[str, Any]:
        """Write ``summary.json`` atomically and print a one-screen table (console backend).

        ``final`` should hold ``initial_val_accuracy``, ``final_val_accuracy``, ``steps``,
        ``wall_seconds`` and ``adv_estimator``; ``steps`` and ``wall_seconds`` default to the
        last logged step and this logger's lifetime. The last value of the reward, entropy,
        Σπ² and grad-norm metrics is added under ``last_metrics``. Returns the written dict.
        """
        if not isinstance(final, Mapping):
            raise TypeError(f"final: expected a mapping, got {type(final).__name__}")
        out: dict[str, Any] = json_safe(final)
        out.setdefault("steps", self._last_step if self._last_step is not None else 0)
        out.setdefault("wall_seconds", time.monotonic() - self._start)
        out["last_metrics"] = {k: self._last[k] for k, _ in _SUMMARY_KEYS if k in self._last}
        if self.nonfinite_counts:
            out["nonfinite_metric_counts"] = dict(self.nonfinite_counts)
        atomic_write_text(self.output_dir / SUMMARY_FILE, json.dumps(out, indent=2) + "\n")
        if "console" in self.backends:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            print(self._summary_table(out), file=self._stream or sys.stdout, flush=True)
        return out

    def _summary_table(self, out: Mapping[str, Any]) -> str:
        rows = [("estimator", _format_value(out.get("adv_estimator")))]
        rows.append(("steps", _format_value(out.get("steps"))))
        wall = out.get("wall_seconds")
        rows.append(
            ("wall time", _format_duration(wall) if isinstance(wall, int | float) else "n/a")
        )
        first, last = out.get("initial_val_accuracy"), out.get("final_val_accuracy")
        accuracy = " -> ".join(
            f"{v:.3f}" if isinstance(v, int | float) else "n/a" for v in (first, last)
        )
        if isinstance(first, int | float) and isinstance(last, int | float):
            accuracy += f"  ({last - first:+.3f})"
        rows.append(("val accuracy", accuracy))
        for key, label in _SUMMARY_KEYS:
            rows.append((label, _format_value(out["last_metrics"].get(key))))
        if self.nonfinite_counts:
            rows.append(("non-finite values", str(sum(self.nonfinite_counts.values()))))
        rows.append(("output", str(self.output_dir)))
        width = max(len(label) for label, _ in rows)
        rule = "-" * 60
        body = "\n".join(f" {label:<{width}}  {value}" for label, value in rows)
        return f"{rule}\n otbrl run summary\n{rule}\n{body}\n{rule}"

    def close(self) -> None:
        """Flush and release every backend; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
