"""otbrl.engine: owns the model, optimizer and layout; computes token statistics, takes steps.

Modules: ``forward`` (one forward → token statistics, padded / packed / fused), ``actor``
(single-process ``Actor`` implementing the ``Engine`` interface). Import from the modules
directly: this package stays import-free so that sibling modules load without the others.
"""
