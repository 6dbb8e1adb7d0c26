"""otbrl.engine: owns models, optimizers and the parallel layout on 1..N processes. Modules:
``world`` (process group, the ``World`` the loop talks to), ``parallel`` (meshes, TP / FSDP2
applied to a plain model), ``ulysses`` (sequence parallel), ``layout`` (one forward →
per-response-token outputs in every layout; the response-row alignment lives there),
``engine`` (``Engine``: compute, update with the loss it is handed; policy, critic and reference
are three instances), ``optim`` (``OptimConfig``, the engine's own training settings), ``state``
(how a model and its optimizer map to checkpoint tensors, behind the engine's public methods),
``dims`` (the parallel layout), ``precision`` and ``memory``. Import from the modules directly:
this package stays import-free so that sibling modules load without the others.
"""
