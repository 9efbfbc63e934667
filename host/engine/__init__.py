"""The engine: paged KV pool, working sets, batched forward passes over a transformers model."""

from .engine import Batch, Engine, Fold, ModelInfo, Pass, PassOutput, resolve_device, resolve_dtype
from .working_set import WorkingSet

__all__ = ["Batch", "Engine", "Fold", "ModelInfo", "Pass", "PassOutput", "WorkingSet", "resolve_device", "resolve_dtype"]
