"""Bringing a rollout backend up to date with the trained policy: the one place that decides
what a backend is sent after an update (plain weights, or a served LoRA adapter alone).
"""

from __future__ import annotations

from torch import nn

from otbrl.models.weights import full_tensors
from otbrl.rollout.protocol import RolloutBackend


def sync_from(backend: RolloutBackend, model: nn.Module) -> None:
    """Stream the trained ``model``'s weights into ``backend`` (``otbrl.models.weights``): its
    LoRA adapter alone when the backend serves adapters (``serves_adapter``), else the plain
    (LoRA: merged) weights. Collective on several processes: every rank calls it."""
    adapter = bool(getattr(backend, "serves_adapter", False))
    backend.sync_weights(full_tensors(model, adapter_only=adapter))
