"""Host adapters: the only host-specific part of the suite. An adapter installs the probe
component, launches one instance with arguments, and collects what it sent and how it ended;
for cases with several instances it also reads what a running instance has sent so far and
cancels one.
The in-process adapter drives host.runtime.Runtime; the daemon adapter (daemon.py) a `pie serve`
over HTTP."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass
class Collected:
    ok: bool
    error: str | None  # how the run failed, when it did
    text: str  # everything the instance sent


class HostAdapter(ABC):
    name: str

    def unavailable(self, model: str) -> str | None:
        """Why this host cannot run cases on `model` (they SKIP with this reason), or None."""
        return None

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

    @abstractmethod
    def sent(self, launched, until: Callable[[str], bool], timeout_s: float) -> str:
        """What the running instance has sent so far, once `until` holds for it, the instance
        has ended, or `timeout_s` has passed, whichever comes first."""

    @abstractmethod
    def cancel(self, launched) -> None:
        """End the instance (a held one, or one past its time); `collect` then returns its end."""

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
                             page_size=suite_model.page_size, heads=suite_model.heads)
        self.runtime = Runtime(self.engine, cache_dir=cache_dir)
        self.wasm: Path | None = None
        self._grammar: bool | None = None

    def capabilities(self) -> set[str]:
        caps = {"cuda"} if self.engine.device_type == "cuda" else set()
        caps |= {"mtp"} if self.engine.info.drafters else set()
        return caps | ({"grammar"} if self._has_grammar() else set())

    def _has_grammar(self) -> bool:
        """Whether the grammar engine reads this model's tokenizer: it compiles a regex."""
        if self._grammar is None:
            from ..errors import InvalidArgument
            from ..runtime.grammars import grammars_for

            try:
                grammars_for(self.engine).compile("regex", "a")
                self._grammar = True
            except InvalidArgument:
                self._grammar = False
        return self._grammar

    def install(self, wasm: Path) -> None:
        self.runtime.load(wasm)  # compiles (or reads the cache) and checks the imports
        self.wasm = wasm

    def launch(self, args: list[str]):
        text, grew = [], threading.Condition()

        def on_text(t: str) -> None:
            with grew:
                text.append(t)
                grew.notify_all()

        handle = self.runtime.start(self.wasm, args, name="probe", on_text=on_text)
        return handle, text, grew

    def collect(self, launched, timeout_s: float) -> Collected:
        handle = launched[0]
        try:
            r = handle.result(timeout_s)
        except TimeoutError:
            handle.cancel("the conformance case timed out")
            r = handle.result()
        return Collected(r.ok, r.error, r.text)

    def sent(self, launched, until: Callable[[str], bool], timeout_s: float) -> str:
        handle, text, grew = launched
        deadline = time.monotonic() + timeout_s
        with grew:  # the run's end sends nothing: wake now and then to see it
            while not until("".join(text)) and handle.thread.is_alive() and time.monotonic() < deadline:
                grew.wait(0.05)
            return "".join(text)

    def cancel(self, launched) -> None:
        launched[0].cancel("the conformance runner ended the held instance")

    def close(self) -> None:
        self.runtime.close()
