"""Executors: how the engine core reaches its workers (in this process, or later one process
per tensor/pipeline-parallel rank, or a simulator)."""
