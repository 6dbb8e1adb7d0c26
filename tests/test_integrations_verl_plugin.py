"""The ``verl.plugins`` entry point: loaded by ``import verl``, skipped when disabled, and a
failure is logged as a warning instead of vanishing (real verl, fresh interpreters)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("verl")

ALL_PARTS = {"estimators": True, "fused_backend": True, "engine": True, "v1_trainer": True}
# The V1 trainer module is patched when it is imported: the probe sees the import hook.
PROBE = """
import json, sys
import verl
from verl.trainer.ppo import core_algos
from verl.models.transformers import monkey_patch
reg = core_algos.ADV_ESTIMATOR_REGISTRY
plugin = sys.modules.get("otbrl.integrations.verl.plugin")
print(json.dumps({
    "loaded": plugin is not None,
    "state": None if plugin is None else plugin.STATE,
    "otb": reg["optimal_token_baseline"].__module__,
    "tir": reg["tir_optimal_token_baseline"].__module__,
    "fused": hasattr(monkey_patch.patch_forward_with_backends, "_otbrl_original"),
    "v1_hook": any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path),
}))
"""


def _probe(**env) -> dict:
    full = {**os.environ, "PYTHONWARNINGS": "ignore", **env}
    for key, value in env.items():
        if value is None:
            full.pop(key)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_is_registered():
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "otbrl"]
    assert [ep.value for ep in eps] == ["otbrl.integrations.verl.plugin"]


def test_import_verl_installs_everything():
    got = _probe(OTBRL_VERL_PLUGIN=None, OTBRL_VERL_ESTIMATORS=None)
    assert got["loaded"]
    assert got["state"] == ALL_PARTS
    assert got["otb"] == got["tir"] == "otbrl.integrations.verl.estimators"
    assert got["fused"] and got["v1_hook"]


def test_estimators_opt_out_keeps_verl_functions():
    got = _probe(OTBRL_VERL_ESTIMATORS="0")
    assert got["state"] == {**ALL_PARTS, "estimators": False}
    assert got["otb"] == got["tir"] == "verl.trainer.ppo.core_algos"


@pytest.mark.parametrize("env", [{"OTBRL_VERL_PLUGIN": "0"}, {"VERL_USE_EXTERNAL_PLUGINS": "none"}])
def test_disabled_plugin_changes_nothing(env):
    got = _probe(**env)
    assert got["otb"] == "verl.trainer.ppo.core_algos" and not got["fused"]
    assert not got["v1_hook"]
    if "VERL_USE_EXTERNAL_PLUGINS" in env:
        assert not got["loaded"]
    else:
        assert got["loaded"] and got["state"] == {}


def test_failure_is_logged_as_warning(monkeypatch, caplog):
    import otbrl.integrations.verl as integration
    from otbrl.integrations.verl import plugin

    def broken(**_):
        raise RuntimeError("simulated breakage")

    monkeypatch.setattr(integration, "install", broken)
    with caplog.at_level(logging.WARNING, logger="otbrl.integrations.verl"):
        assert plugin.load() is None
    assert "simulated breakage" in caplog.text and "verl runs unchanged" in caplog.text
    monkeypatch.undo()
    assert plugin.load() == ALL_PARTS


def test_other_verl_version_refused(monkeypatch):
    import verl

    import otbrl.integrations.verl as integration

    monkeypatch.setattr(verl, "__version__", "0.10.0")
    with pytest.raises(RuntimeError, match=r"verl==0\.9\.1"):
        integration.install()
