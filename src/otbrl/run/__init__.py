"""The run layer (floor 4, orchestration only): ``build`` (validate the config once, build a
run), ``trainer`` (the one RL loop for 1..N processes), ``evaluate`` (validation accuracy),
``sft`` (the built-in model's warm start), ``checkpoint`` (one format for every engine) and
``outputs`` / ``plotting`` (run files). Import from the modules directly."""
