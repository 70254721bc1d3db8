"""forge_checkpoint: training checkpoints that survive crashes and change layout, and export.

- :class:`Checkpointer`: save and load model + optimizer state with torch.distributed.checkpoint
  under ``<root>/step-NNNNNNNN``: each rank writes its shards, a save is atomic (written into a
  temporary directory, renamed when every rank is done), optionally asynchronous, and loads into
  any other layout (FSDP2, TP, EP, one process) (:mod:`forge_checkpoint.dcp`)
- :func:`verify_checkpoint`, :func:`latest_intact`, :func:`foreign_dirs`, :func:`checkpoint_lock`,
  :class:`CheckpointDamaged`: the marker (forge wrote this directory), the manifest (size +
  CRC-32 of every file, written last), its verification with the train state's own checks, and
  a one-writer lock, without importing torch (:mod:`forge_checkpoint.files`)
- :func:`verify_shards`: every rank's shard and RNG file carries its checkpoint's id
  (:mod:`forge_checkpoint.binding`); :func:`model_shapes`: the tensor shapes a checkpoint's DCP
  index records, read by an unpickler that admits exact globals only
  (:mod:`forge_checkpoint.index`)
- :func:`load_model_weights`, :func:`load_model_tensors`: fill a model (or some of its tensors)
  from a checkpoint's shards in one process
- :func:`export_hf_model`, :func:`load_checkpoint_tensors`: a trained Hugging Face model back
  to a Hugging Face directory, one shard at a time (:mod:`forge_checkpoint.hf_export`)
- :func:`load_hf_weights`, :func:`hf_weight_problems`, :func:`hf_weight_shapes`: a Hugging Face
  model directory's safetensors into a parallelized model, each rank reading only its slices,
  and the check of names and shapes before any rank starts (:mod:`forge_checkpoint.hf_weights`)
- :func:`to_hf_llama`, :func:`from_hf_llama`, :func:`export_hf_llama`, :func:`save_safetensors`,
  :func:`load_safetensors`: the reference Transformer <-> Hugging Face Llama, one-file
  safetensors with shared tensors kept shared (:mod:`forge_checkpoint.export`)

Depends on forge_core, torch and safetensors (transformers only for ``hf_llama_config``).
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

_EXPORTS = {
    "MANIFEST": "files",
    "MARKER": "files",
    "STATE_FILE": "files",
    "CheckpointDamaged": "files",
    "check_train_state": "files",
    "checkpoint_lock": "files",
    "find_latest": "files",
    "foreign_dirs": "files",
    "forge_written": "files",
    "latest_intact": "files",
    "read_train_state": "files",
    "verify_checkpoint": "files",
    "verify_shards": "binding",
    "RefusedPickle": "index",
    "model_shapes": "index",
    "CheckpointIOError": "dcp",
    "Checkpointer": "dcp",
    "SafeFileSystemReader": "dcp",
    "load_model_weights": "dcp",
    "load_model_tensors": "dcp",
    "export_hf_model": "hf_export",
    "load_checkpoint_tensors": "hf_export",
    "optimizer_hyperparameters": "dcp",
    "HF_INDEX": "hf_weights",
    "HF_SINGLE": "hf_weights",
    "hf_weight_files": "hf_weights",
    "hf_weight_problems": "hf_weights",
    "hf_weight_shapes": "hf_weights",
    "load_hf_weights": "hf_weights",
    "export_hf_llama": "export",
    "from_hf_llama": "export",
    "hf_llama_config": "export",
    "load_safetensors": "export",
    "save_safetensors": "export",
    "to_hf_llama": "export",
}

if TYPE_CHECKING:
    from .binding import verify_shards
    from .dcp import (
        Checkpointer,
        CheckpointIOError,
        SafeFileSystemReader,
        load_model_tensors,
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
        MARKER,
        STATE_FILE,
        CheckpointDamaged,
        check_train_state,
        checkpoint_lock,
        find_latest,
        foreign_dirs,
        forge_written,
        latest_intact,
        read_train_state,
        verify_checkpoint,
    )
    from .hf_export import export_hf_model, load_checkpoint_tensors
    from .hf_weights import (
        HF_INDEX,
        HF_SINGLE,
        hf_weight_files,
        hf_weight_problems,
        hf_weight_shapes,
        load_hf_weights,
    )
    from .index import RefusedPickle, model_shapes

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"

__all__ = [
    "HF_INDEX",
    "HF_SINGLE",
    "CheckpointDamaged",
    "CheckpointIOError",
    "Checkpointer",
    "MANIFEST",
    "MARKER",
    "RefusedPickle",
    "STATE_FILE",
    "SafeFileSystemReader",
    "check_train_state",
    "checkpoint_lock",
    "export_hf_llama",
    "export_hf_model",
    "find_latest",
    "foreign_dirs",
    "forge_written",
    "from_hf_llama",
    "hf_llama_config",
    "hf_weight_files",
    "hf_weight_problems",
    "hf_weight_shapes",
    "latest_intact",
    "load_checkpoint_tensors",
    "load_hf_weights",
    "load_model_tensors",
    "load_model_weights",
    "load_safetensors",
    "model_shapes",
    "optimizer_hyperparameters",
    "read_train_state",
    "save_safetensors",
    "to_hf_llama",
    "verify_checkpoint",
    "verify_shards",
]
