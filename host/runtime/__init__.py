"""The wasmtime component runtime: loads inferlets, binds the WIT imports to the engine, runs them."""

from .runtime import Limits, RunResult, Runtime

__all__ = ["Limits", "RunResult", "Runtime"]
