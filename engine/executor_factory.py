"""create_executor: the executor for a config.

A module of its own because it names both executors: engine.distributed_executor builds on
engine.executor's ExecutorBase, so a factory inside engine.executor would import its own importer.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.distributed_executor import DistributedExecutor
from engine.executor import ExecutorBase, LocalExecutor


def create_executor(config: EngineConfig) -> ExecutorBase:
    """The executor for a config: one process, or tensor/pipeline parallel ranks."""
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        return DistributedExecutor(config)
    return LocalExecutor(config)
