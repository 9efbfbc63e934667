"""The README's commands work, and no file of the repository points outside it.

The README's ```sh blocks are read as a user would copy them (a line ending in a backslash joins
the next; `#` starts a comment). The commands that need no server and no long run are run here:
`pie ... --help`, `pie model list`, and `pie run` of a built inferlet in-process, with its
`--max-tokens` capped at MAX_TOKENS to keep the run short. Everything else (make, set-up, imports
that change the store, pie serve and its clients, training, benchmarks) is left to the user; the
counts below make sure a README edit does not quietly leave nothing to run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PIE = ".venv/bin/pie"
MAX_TOKENS = 8
TIMEOUT_S = 180  # a shared 2-core machine under load: the model and the component load in seconds
# never a path to the shared folder beside the checkout; spelled in parts so this file holds neither
OUTSIDE = ("../" + "shared", "/work/" + "shared")


def sh_commands(text: str) -> list[str]:
    """Every command line of the text's ```sh blocks, continuation lines joined, comments cut."""
    out = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(shlex.join(words))
    return out


def runnable(command: str) -> bool:
    """A command this test runs: pie's help, the model list, or an in-process `pie run` of a
    built inferlet with concrete arguments."""
    words = shlex.split(command)
    if words[0] != PIE or any("..." in w for w in words):
        return False
    if "--help" in words or words[1:] in (["model", "list"], ["model", "list", "--json"]):
        return True
    if words[1] != "run" or "--server" in words or "--" not in words:
        return False
    return (ROOT / "build" / "inferlets" / f"{words[2]}.wasm").exists() or \
        (ROOT / "inferlets" / words[2] / "manifest.toml").is_file()


def is_run(command: str) -> bool:
    """An in-process `pie run` of an inferlet (not its help)."""
    words = shlex.split(command)
    return words[1] == "run" and "--help" not in words


def capped(words: list[str]) -> list[str]:
    """`pie run ... -- ARGS` with --max-tokens at most MAX_TOKENS (added when ARGS has none)."""
    words = list(words)
    if "--max-tokens" in words:
        i = words.index("--max-tokens") + 1
        words[i] = str(min(int(words[i]), MAX_TOKENS))
    else:
        words += ["--max-tokens", str(MAX_TOKENS)]
    return words


COMMANDS = [c for c in sh_commands(README.read_text()) if runnable(c)]


def _marks(command: str) -> list:
    return [pytest.mark.model, pytest.mark.wasm] if is_run(command) else []


def test_the_readme_has_commands_to_run():
    runs = [c for c in COMMANDS if is_run(c)]
    assert len(COMMANDS) >= 3 and len(runs) >= 2, f"the README's runnable commands: {COMMANDS}"


@pytest.fixture(scope="module")
def ready():
    """The default model in the store and the README's inferlets built (no-ops after `make test`'s set-up)."""
    from wasm_fixtures import build_inferlet

    from host import store
    from host.errors import ModelNotFound

    try:
        store.read_record(store.DEFAULT_MODEL)
    except ModelNotFound:
        store.import_model(store.DEFAULT_MODEL, progress=False)
    for name in {shlex.split(c)[2] for c in COMMANDS if is_run(c)}:
        if (ROOT / "inferlets" / name / "manifest.toml").is_file():
            build_inferlet(name)


@pytest.mark.parametrize("command", [pytest.param(c, marks=_marks(c), id=c[len(PIE) + 1:][:60]) for c in COMMANDS])
def test_readme_command_runs(command, request):
    words = shlex.split(command)
    if is_run(command):
        request.getfixturevalue("ready")
        words = capped(words)
    done = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{shlex.join(words)} exited {done.returncode}:\n{done.stderr[-2000:]}"
    assert done.stdout.strip(), f"{shlex.join(words)} printed nothing"


def repository_files() -> list[Path]:
    """The files git tracks, and those it would add (untracked, not ignored), that exist."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return [ROOT / n for n in sorted(set(out.decode().split("\0"))) if n and (ROOT / n).is_file()]


def test_no_file_refers_outside_the_repository():
    found = []
    for path in repository_files():
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if any(s in line for s in OUTSIDE):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not found, "files that name a path outside the repository:\n" + "\n".join(found)
