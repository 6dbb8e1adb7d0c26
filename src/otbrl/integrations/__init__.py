"""Plug-ins that bring otbrl's Optimal Token Baseline to frameworks people already train with.

- ``otbrl.integrations.trl`` (``pip install 'otbrl[trl]'``): ``OTBGRPOConfig`` /
  ``OTBGRPOTrainer``, TRL's ``GRPOTrainer`` with per-token OTB advantages.
- ``otbrl.integrations.verl`` (``pip install 'otbrl[verl]'``): loaded by ``import verl`` through
  the ``verl.plugins`` entry point; vectorized OTB estimators and Σπ² on verl's fused path.

Both are built only from ``otbrl.ops`` and ``otbrl.algos``; importing this package imports
neither TRL nor verl (see docs/integrations.md).
"""
