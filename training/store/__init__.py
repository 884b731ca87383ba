"""Storage: object stores (file / gs / memory), tensor encoding, the experiment layout."""

from training.store.experiment import (
    DoubleApply,
    ExperimentExists,
    ExperimentStore,
    FragmentVersion,
    HeadPointer,
    PseudoGradRef,
    Snapshot,
)
from training.store.objectstore import (
    CorruptObject,
    Generation,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    StoreUnreachable,
    TransientStoreError,
    retry,
)
from training.store.registry import open_store
from training.store.tensors import decode_tensors, encode_tensors, flatten, sha256, unflatten

__all__ = [
    "CorruptObject",
    "DoubleApply",
    "ExperimentExists",
    "ExperimentStore",
    "Generation",
    "FragmentVersion",
    "Snapshot",
    "HeadPointer",
    "ObjectNotFound",
    "ObjectStore",
    "PseudoGradRef",
    "StoreError",
    "StoreUnreachable",
    "TransientStoreError",
    "decode_tensors",
    "encode_tensors",
    "flatten",
    "open_store",
    "retry",
    "sha256",
    "unflatten",
]
