"""otbrl: RL post-training of language models with the Optimal Token Baseline.

Floors (imports only point down; docs/architecture.md): ``ops`` / ``algos`` (the math) →
``data`` / ``rewards`` / ``models`` / ``tools`` → ``engine`` / ``rollout`` / ``store`` → ``run`` /
``report`` → ``research`` → ``cli``.
"""

__version__ = "0.1.0"
