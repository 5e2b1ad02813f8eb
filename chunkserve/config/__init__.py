"""Configuration leaves: what each owner reads (the engine's arguments, the scheduler's
settings, where the model lives). Torch-free; every layer may import it."""

from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import ModelSource, resolve_model
from chunkserve.config.scheduler import ChunkSchedule, SchedulerConfig

__all__ = ["ChunkSchedule", "EngineArgs", "ModelSource", "SchedulerConfig", "resolve_model"]
