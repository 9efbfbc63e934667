"""Fixtures for tests that run inferlets: built components (cached by source hash) and a runtime.

Import the fixtures into a test module with `from wasm_fixtures import *`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_INFERLETS = ROOT / "tests" / "inferlets"
TEST_BUILD = ROOT / "build" / "test-inferlets"
# compiled-component cache kept under build/, so a second test session does not recompile
TEST_CACHE = ROOT / "build" / "test-cache"


def _build_module():
    spec = importlib.util.spec_from_file_location("pie_inferlet_build", ROOT / "inferlets" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_inferlet(name: str) -> Path:
    """Build inferlets/<name> into build/inferlets (a no-op when its sources are unchanged)."""
    return _build_module().build_one(ROOT / "inferlets" / name, ROOT / "build" / "inferlets")


def build_test_inferlet(name: str, world: str = "inferlet") -> Path:
    b = _build_module()
    src = TEST_INFERLETS / name
    wit = src / "wit" if (src / "wit").is_dir() else b.WIT
    return b.build_one(src, TEST_BUILD, wit=wit, world=world)


@pytest.fixture(scope="session")
def text_completion_wasm() -> Path:
    return build_inferlet("text-completion")


@pytest.fixture(scope="session")
def misbehave_wasm() -> Path:
    return build_test_inferlet("misbehave")


@pytest.fixture(scope="session")
def other_world_wasm() -> Path:
    return build_test_inferlet("other-world", world="other")


@pytest.fixture(scope="session")
def bad_imports_wasm() -> Path:
    return build_test_inferlet("bad-imports", world="bad-imports")


@pytest.fixture(scope="session")
def runtime(engine):
    from host.runtime import Runtime

    rt = Runtime(engine, cache_dir=TEST_CACHE)
    yield rt
    rt.close()


__all__ = ["bad_imports_wasm", "misbehave_wasm", "other_world_wasm", "runtime", "text_completion_wasm"]
