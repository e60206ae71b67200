"""The engine: one thread owns the models and runs the step loop (engine.py); each step is
scheduler -> speculative cycle -> commit (core.py). See docs/architecture.md."""

from quickdraft.engine.core import EngineCore, StepStats, stream
from quickdraft.engine.engine import (
    Engine,
    EngineDeadError,
    QueueFullError,
    RequestHandle,
    RequestOutput,
    ServedModel,
)
from quickdraft.engine.scheduler import SchedulerConfig

__all__ = [
    "Engine",
    "EngineCore",
    "EngineDeadError",
    "QueueFullError",
    "RequestHandle",
    "RequestOutput",
    "SchedulerConfig",
    "ServedModel",
    "StepStats",
    "stream",
]
