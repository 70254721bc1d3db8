"""forge_checkpoint: training checkpoints that survive crashes and change layout, and export.

- :class:`Checkpointer`: save and load model + optimizer state with torch.distributed.checkpoint
  under ``<root>/step-NNNNNNNN``: each rank writes its shards, a save is atomic (written into a
  temporary directory, renamed when every rank is done), optionally asynchronous, and loads into
  any other layout (FSDP2, TP, EP, one process) (:mod:`forge_checkpoint.dcp`)
- :func:`verify_checkpoint`, :func:`latest_intact`, :func:`checkpoint_lock`,
  :class:`CheckpointDamaged`: the manifest (size + CRC-32 of every file, written last), its
  verification and a one-writer lock, without importing torch (:mod:`forge_checkpoint.files`)
- :func:`load_model_weights`: fill a model from a checkpoint's shards in one process
- :func:`to_hf_llama`, :func:`from_hf_llama`, :func:`export_hf_llama`, :func:`save_safetensors`,
  :func:`load_safetensors`: the reference Transformer <-> Hugging Face Llama, one-file
  safetensors with shared tensors kept shared (:mod:`forge_checkpoint.export`)

Depends on forge_core, torch and safetensors (transformers only for ``hf_llama_config``).
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

_EXPORTS = {
    "MANIFEST": "files",
    "STATE_FILE": "files",
    "CheckpointDamaged": "files",
    "checkpoint_lock": "files",
    "find_latest": "files",
    "latest_intact": "files",
    "read_train_state": "files",
    "verify_checkpoint": "files",
    "CheckpointIOError": "dcp",
    "Checkpointer": "dcp",
    "SafeFileSystemReader": "dcp",
    "load_model_weights": "dcp",
    "optimizer_hyperparameters": "dcp",
    "export_hf_llama": "export",
    "from_hf_llama": "export",
    "hf_llama_config": "export",
    "load_safetensors": "export",
    "save_safetensors": "export",
    "to_hf_llama": "export",
}

if TYPE_CHECKING:
    from .dcp import (
        Checkpointer,
        CheckpointIOError,
        SafeFileSystemReader,
        load_model_weights,
        optimizer_hyperparameters,
    )
    from .export import (
        export_hf_llama,
        from_hf_llama,
        hf_llama_config,
        load_safetensors,
        save_safetensors,
        to_hf_llama,
    )
    from .files import (
        MANIFEST,
        STATE_FILE,
        CheckpointDamaged,
        checkpoint_lock,
        find_latest,
        latest_intact,
        read_train_state,
        verify_checkpoint,
    )

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"

__all__ = [
    "CheckpointDamaged",
    "CheckpointIOError",
    "Checkpointer",
    "MANIFEST",
    "STATE_FILE",
    "SafeFileSystemReader",
    "checkpoint_lock",
    "export_hf_llama",
    "find_latest",
    "from_hf_llama",
    "hf_llama_config",
    "latest_intact",
    "load_model_weights",
    "load_safetensors",
    "optimizer_hyperparameters",
    "read_train_state",
    "save_safetensors",
    "to_hf_llama",
    "verify_checkpoint",
]
