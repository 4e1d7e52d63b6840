"""Starting vLLM on probe-mtp's models: the folder vLLM reads and the engine's settings.

vLLM reads Hugging Face folders, not the GGUF files the embedded models ship as: an embedded model
(``smollm2-135m``, ``gemma3-270m``) or a ``.gguf`` file is served from probe-mtp's converted float32
copy (:func:`probe_mtp.loading.converted_copy`, written at the first use); a folder is served as it
is.  Scripts that start an engine must guard their top level with ``if __name__ == "__main__":``
(vLLM's engine core runs in a spawned process)."""

from __future__ import annotations

import json
from pathlib import Path

from ..loading import DEFAULT_MODEL, converted_copy, resolve_model_source

PROPOSER = "probe_mtp.vllm.Proposer"  # speculative_config["model"] for method "custom_class"
DEFAULT_KV_CACHE_BYTES = 1 << 30  # the CPU backend's KV cache (VLLM_CPU_KVCACHE_SPACE, in bytes)


def model_folder(model: str | None = None) -> str:
    """The folder vLLM reads for ``model`` (an embedded model's name, a ``.gguf`` file or a Hugging
    Face folder; default: the embedded SmolLM2)."""
    name = model or DEFAULT_MODEL
    _, extra = resolve_model_source(name)
    if "gguf_file" in extra:
        return str(converted_copy(name))
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ValueError(f"{name!r} is neither an embedded model, a .gguf file nor a model folder here "
                         "(vLLM reads hub ids itself: pass them to vllm.LLM directly)")
    return str(path)


def plugin_architecture(folder: str) -> str:
    """The model plugin's class for the model in ``folder`` (its ``config.json`` ``architectures``)."""
    from .plugin import architecture_for

    config = Path(folder) / "config.json"
    try:
        names = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the architecture of {folder} ({exc})") from None
    if not names:
        raise ValueError(f"{config} names no architecture: the probe masks need the model plugin's class for it")
    return architecture_for(names[0])


def speculative_config(num_speculative_tokens: int = 8) -> dict:
    """vLLM's ``speculative_config`` for probe-mtp's proposer (:class:`probe_mtp.vllm.Proposer`):
    ``LLM(model, speculative_config=speculative_config())``; ``num_speculative_tokens`` caps each
    chain.  The proposer's options go in ``additional_config={"probe_mtp": {...}}`` (see
    :class:`~probe_mtp.vllm.proposer.ProposerSettings`; :func:`engine`'s ``proposer``)."""
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
            or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": num_speculative_tokens}


def engine(model: str | None = None, *, speculative: dict | None = None, dtype: str = "float32",
           max_num_seqs: int = 8, max_model_len: int = 2048, kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
           proposer: dict | None = None, **kwargs):
    """A ``vllm.LLM`` on ``model`` (see :func:`model_folder`) for greedy or sampled decoding on the
    CPU: eager mode (no compilation), statistics on (``llm.get_metrics()``), ``speculative`` as
    ``speculative_config``, ``proposer``: the probe-mtp proposer's options (checked here, before
    the engine starts; with ``num_masks`` >= 1 the model is served through the model plugin's class
    for its architecture unless ``hf_overrides`` says otherwise); ``kwargs`` go to ``vllm.LLM``."""
    import vllm

    from .proposer import CONFIG_KEY, ProposerSettings

    folder = model_folder(model)
    options = dict(model=folder, dtype=dtype, enforce_eager=True, max_num_seqs=max_num_seqs,
                   max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_bytes, disable_log_stats=False,
                   seed=0)
    if proposer is not None:
        settings = ProposerSettings.from_options(proposer)
        options["additional_config"] = {CONFIG_KEY: dict(proposer)}
        if settings.num_masks and "hf_overrides" not in kwargs:
            options["hf_overrides"] = {"architectures": [plugin_architecture(folder)]}
    options.update(kwargs)
    if speculative is not None:
        options["speculative_config"] = speculative
    return vllm.LLM(**options)
