"""Research tools beside the training loop, off its path: empirical gradient variance per
estimator (``variance``, ``gradient_probe``, ``gradient_variance``) and equal-budget training
comparisons (``compare``). Import from the modules directly."""
