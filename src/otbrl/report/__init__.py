"""otbrl.report (floor 4): what a run shows — the metrics log (``metrics_log``: progress bar,
``metrics.jsonl``, TensorBoard / W&B, the summary) and the curves (``plots``). No torch here.
Import from the modules directly."""
