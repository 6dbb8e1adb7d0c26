"""A learned reward model: an HF ``AutoModelForSequenceClassification`` with one label that
scores prompt + response as its own chat template renders them (``reward.model.path``).

Frozen (no optimizer, no gradients), batched, on this process's device. Its tokenizer and
template are its own, not the policy's: the prompt's chat messages and the decoded response
are rendered again, so a reward model trained on another model's template scores text it
knows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch


def check_reward_model_dir(path: str | Path) -> None:
    """``ValueError`` naming what is wrong unless ``path`` holds a one-label sequence
    classifier with a tokenizer that has a chat template (read from its files: no model is
    loaded)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is not an HF model directory (no config.json)")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"{path} holds {architectures or 'no architecture'}, expected an "
            "AutoModelForSequenceClassification model (e.g. LlamaForSequenceClassification)"
        )
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        raise ValueError(f"{path} has {labels} labels, expected 1 (a scalar reward)")
    has_template = (path / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (path / "tokenizer_config.json").read_text()
        if (path / "tokenizer_config.json").is_file()
        else "{}"
    )
    if not has_template:
        raise ValueError(f"{path}: its tokenizer has no chat template to render the samples with")


class RewardModel:
    """``RewardModel(path).score(rows, responses) -> [B] float32``: the model's scalar for
    each row's prompt messages followed by the response as the assistant turn."""

    def __init__(
        self,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        micro_batch_size: int = 16,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_reward_model_dir(path)
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size: expected an int >= 1, got {micro_batch_size!r}")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, dtype)
        )
        # the classifier reads the last non-pad token: it must know the pad id
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size

    def texts(self, rows: Sequence[dict], responses: Sequence[str]) -> list[str]:
        """The conversations as the reward model's chat template renders them."""
        if len(rows) != len(responses):
            raise ValueError(f"rows: expected {len(responses)} rows, got {len(rows)}")
        return [
            self.tokenizer.apply_chat_template(
                [*row["prompt"], {"role": "assistant", "content": response}], tokenize=False
            )
            for row, response in zip(rows, responses)
        ]

    @torch.no_grad()
    def score(self, rows: Sequence[dict], responses: Sequence[str]) -> torch.Tensor:
        """[B] float32 rewards, ``micro_batch_size`` conversations per forward."""
        texts = self.texts(rows, responses)
        out = []
        for start in range(0, len(texts), self.micro_batch_size):
            enc = self.tokenizer(
                texts[start : start + self.micro_batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,  # the template wrote the special tokens
            ).to(self.device)
            logits = self.model(**enc).logits
            out.append(logits[:, 0].float().cpu())
        return torch.cat(out) if out else torch.zeros(0)
