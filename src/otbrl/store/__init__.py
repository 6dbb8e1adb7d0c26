"""otbrl.store (floor 3): what a run keeps on disk, with no RL in it — checkpoints (``checkpoint``:
one format for every engine and world size, written and read through the engine's public state
methods; ``export``: a checkpoint as a plain HF model or adapter), the trainer state codec
(``state_codec``: JSON + safetensors, no pickle), integrity manifests (``integrity``),
JSON-ready values (``plain``), atomic, durable file writes (``files``) and safetensors files
written tensor by tensor (``tensor_file``). Import from the modules directly."""
