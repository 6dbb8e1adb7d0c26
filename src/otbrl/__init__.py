"""otbrl: RL post-training of language models with the Optimal Token Baseline.

Floors (imports only point down): ``ops`` (pure tensor math) → ``algos`` / ``data`` /
``rewards`` / ``models`` → ``engine`` / ``rollout`` → ``trainer`` → ``cli``.
"""

__version__ = "0.1.0"
