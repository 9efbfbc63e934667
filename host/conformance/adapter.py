"""Host adapters: the only host-specific part of the suite. An adapter installs the probe
component, launches one instance with arguments, and collects what it sent and how it ended.
The in-process adapter drives host.runtime.Runtime; a daemon adapter is a later step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Collected:
    ok: bool
    error: str | None  # how the run failed, when it did
    text: str  # everything the instance sent


class HostAdapter(ABC):
    name: str

    @abstractmethod
    def capabilities(self) -> set[str]:
        """Which of case.CAPABILITIES this host has."""

    @abstractmethod
    def install(self, wasm: Path) -> None:
        """Make the component runnable (a refusal raises)."""

    @abstractmethod
    def launch(self, args: list[str]) -> object:
        """Start one instance of the installed component; returns what `collect` takes."""

    @abstractmethod
    def collect(self, launched, timeout_s: float) -> Collected:
        """Wait for the instance to end."""

    def close(self) -> None:
        pass


class InProcessAdapter(HostAdapter):
    """The host in this process: an Engine over the suite model's weights and a Runtime."""

    name = "in-process"

    def __init__(self, suite_model, cache_dir: Path | None = None, device: str = "cpu"):
        from ..engine import Engine
        from ..runtime import Runtime

        model = suite_model.model.to(device)
        self.engine = Engine(model, suite_model.tokenizer, name=suite_model.name, kv_pages=suite_model.kv_pages,
                             page_size=suite_model.page_size)
        self.runtime = Runtime(self.engine, cache_dir=cache_dir)
        self.wasm: Path | None = None

    def capabilities(self) -> set[str]:
        caps = {"cuda"} if self.engine.device_type == "cuda" else set()
        return caps | ({"mtp"} if self.engine.info.drafters else set())

    def install(self, wasm: Path) -> None:
        self.runtime.load(wasm)  # compiles (or reads the cache) and checks the imports
        self.wasm = wasm

    def launch(self, args: list[str]):
        return self.runtime.start(self.wasm, args, name="probe")

    def collect(self, launched, timeout_s: float) -> Collected:
        try:
            r = launched.result(timeout_s)
        except TimeoutError:
            launched.cancel("the conformance case timed out")
            r = launched.result()
        return Collected(r.ok, r.error, r.text)

    def close(self) -> None:
        self.runtime.close()
