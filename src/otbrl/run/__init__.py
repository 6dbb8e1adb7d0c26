"""The run layer (floor 4, orchestration only): ``plan`` (validate the config once, before any
model loads → ``Plan``), ``build`` (the parts of a run from the plan), ``seeds``, ``sampling``
(the one sampling step), ``trainer`` (the one RL loop for 1..N processes), ``evaluate``
(validation), ``sft`` (the built-in model's warm start) and ``presets`` (built-in tasks' own
settings). Import from the modules directly."""
