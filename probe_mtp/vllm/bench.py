"""``probe-mtp bench --engine vllm``: plain vLLM, vLLM's ``ngram`` and ``suffix`` methods and probe-mtp's
proposer on the same prompts, in one process (run it in ``.venv-vllm``: ``make vllm``).

Each method runs twice, each time in an engine of its own started afresh (so that no method's
cross-request cache holds the other run's outputs): the prompts one request at a time, then all
of them submitted together (vLLM batches ``--concurrency`` of them at once).  Per method and mode:
tokens/s (new tokens over the wall time of the generate calls, after an untimed warm-up request
that is not one of the prompts), tau (new tokens per verification step of a request:
``tokens / (tokens - accepted draft tokens)``, from vLLM's counters) and how many outputs are
identical to plain vLLM's in the same mode.  Greedy decoding, float32.

Records (a JSON list, to ``--out``: a ``.json`` file, or ``vllm-bench.json`` in a folder): ``method``
("vllm", "vllm-ngram", "vllm-suffix", "probe-mtp"), ``concurrency``, ``tokens_per_second``,
``speedup`` (over plain vLLM in the same mode), ``tau``, ``identical`` (prompts whose output equals
plain vLLM's), ``prompts``, ``new_tokens``, ``seconds``, and the run's settings and processor."""

from __future__ import annotations

import gc
import importlib.util
import json
import platform
import time
from pathlib import Path

from .engine import engine, model_folder, speculative_config

METHODS = ("vllm", "vllm-ngram", "vllm-suffix", "probe-mtp")
WARMUP_PROMPT = "Count from one to twenty, in words."


def method_config(method: str, k: int) -> dict | None:
    """vLLM's ``speculative_config`` of a bench method (None: plain decoding)."""
    if method == "vllm":
        return None
    if method == "vllm-ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    if method == "vllm-suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if method == "probe-mtp":
        return speculative_config(k)
    raise ValueError(f"unknown method {method!r}; one of {METHODS}")


def suffix_available() -> str | None:
    """None where vLLM's ``suffix`` method can run here, else why not."""
    if importlib.util.find_spec("arctic_inference") is None:
        return "arctic-inference is not installed (make vllm-suffix; it builds from source)"
    return None


def processor() -> str:
    """The processor's name and its matrix-unit flags."""
    name, flags = platform.processor() or "unknown processor", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", "unknown processor", platform.machine()):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    units = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{name} ({', '.join(units) or 'no avx2'})"


def _counter(llm, name: str) -> float:
    total = 0.0
    for metric in llm.get_metrics():
        if metric.name == name and hasattr(metric, "value"):
            total += float(metric.value)
    return total


def _shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def run_method(method: str, model: str, prompts: list[list[int]], max_new_tokens: int, k: int,
               concurrency: int, max_model_len: int, warmup: list[int],
               proposer: dict | None = None) -> tuple[dict, list[list[int]]]:
    """One method in one mode, in a fresh engine: the figures and each prompt's output tokens."""
    from vllm import SamplingParams, TokensPrompt

    llm = engine(model, speculative=method_config(method, k), max_num_seqs=max(concurrency, 1),
                 max_model_len=max_model_len, proposer=proposer if method == "probe-mtp" else None)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        llm.generate([TokensPrompt(prompt_token_ids=warmup)], SamplingParams(temperature=0.0, max_tokens=16),
                     use_tqdm=False)
        accepted_before = _counter(llm, "vllm:spec_decode_num_accepted_tokens")
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outputs: list[list[int]] = []
        seconds = 0.0
        groups = [[r] for r in requests] if concurrency == 1 else [requests]
        for group in groups:
            start = time.perf_counter()
            done = llm.generate(group, params, use_tqdm=False)
            seconds += time.perf_counter() - start
            outputs.extend(list(o.outputs[0].token_ids) for o in done)
        accepted = _counter(llm, "vllm:spec_decode_num_accepted_tokens") - accepted_before
    finally:
        _shutdown(llm)
        del llm
        gc.collect()
    tokens = sum(len(o) for o in outputs)
    steps = tokens - accepted
    return {"method": method, "concurrency": concurrency, "new_tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_second": round(tokens / seconds, 2) if seconds else None,
            "tau": round(tokens / steps, 3) if steps > 0 else None, "accepted_draft_tokens": int(accepted)}, outputs


def run_bench(model: str | None, prompt_file: str | None, tasks, limit: int, max_new_tokens: int, methods=METHODS,
              concurrency: int = 8, k: int = 8, max_model_len: int = 4096, proposer: dict | None = None,
              log=print) -> list[dict]:
    """Every method one request at a time and ``concurrency`` at a time (see the module docstring)."""
    from transformers import AutoTokenizer

    from ..prompts import balanced_subset, chat_input_ids, load_prompts

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown vLLM bench methods {unknown}; choose from {METHODS}")
    if "vllm" not in methods:
        methods = ("vllm",) + tuple(methods)  # the reference of speed and identity
    if max_new_tokens < 1 or concurrency < 1 or k < 1:
        raise ValueError("--max-new-tokens, the concurrency and the draft length must be >= 1")
    folder = model_folder(model)
    prompts = load_prompts(prompt_file)
    selected = balanced_subset(prompts, limit, tasks) if limit else [p for p in prompts if not tasks or p.task in tasks]
    if not selected:
        raise ValueError("no prompts selected")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = [chat_input_ids(tokenizer, [{"role": "user", "content": p.turns[0]}])[0].tolist() for p in selected]
    warmup = chat_input_ids(tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])[0].tolist()
    longest = max(len(x) for x in ids) + max_new_tokens + k + 1
    max_model_len = max(max_model_len, longest)
    skipped = {}
    if "vllm-suffix" in methods and suffix_available():
        skipped["vllm-suffix"] = suffix_available()
        methods = tuple(m for m in methods if m != "vllm-suffix")
    info = {"model": model or "smollm2-135m", "dtype": "float32", "processor": processor(), "proposer": proposer or {},
            "max_new_tokens": max_new_tokens, "num_speculative_tokens": k}
    records = []
    for mode in dict.fromkeys((1, concurrency)):
        reference = None
        base_speed = None
        for method in methods:
            figures, outputs = run_method(method, model, ids, max_new_tokens, k, mode, max_model_len, warmup,
                                          proposer)
            if method == "vllm":
                reference, base_speed = outputs, figures["tokens_per_second"]
            same = sum(a == b for a, b in zip(outputs, reference))
            figures.update(identical=same, prompts=len(ids),
                           speedup=round(figures["tokens_per_second"] / base_speed, 3) if base_speed else None, **info)
            records.append(figures)
            log(f"{method:12s} concurrency {mode}: {figures['tokens_per_second']} tok/s "
                f"({figures['speedup']}x vLLM), tau {figures['tau']}, identical {same}/{len(ids)}")
    for method, why in skipped.items():
        records.append({"method": method, "skipped": why, "prompts": len(ids), **info})
        log(f"{method:12s} skipped: {why}")
    return records


def markdown_table(records: list[dict]) -> str:
    lines = ["| method | requests at once | tokens/s | vs vLLM | tau | identical to vLLM |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if "skipped" in r:
            lines.append(f"| {r['method']} | - | skipped: {r['skipped']} | | | |")
            continue
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['tokens_per_second']} | {r['speedup']}x | "
                     f"{r['tau']} | {r['identical']}/{r['prompts']} |")
    return "\n".join(lines)


def cmd_vllm_bench(args) -> int:
    """``probe-mtp bench --engine vllm`` (the bench's ``--model``, ``--prompts``, ``--tasks``,
    ``--limit``, ``--max-new-tokens``, ``--out``; ``--vllm-methods``, ``--concurrency``,
    ``--speculative-tokens``, ``--vllm-proposer``)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("--engine vllm needs vLLM: run it in .venv-vllm (make vllm)")
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) if args.tasks else None
    methods = tuple(m.strip() for m in (args.vllm_methods or ",".join(METHODS)).split(",") if m.strip())
    proposer = None
    if args.vllm_proposer:
        try:
            proposer = json.loads(args.vllm_proposer)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--vllm-proposer must be a JSON object of proposer options ({exc})") from None
    records = run_bench(args.model, args.prompts, tasks, args.limit if args.limit is not None else 2,
                        args.max_new_tokens or 128, methods, concurrency=args.concurrency, k=args.speculative_tokens,
                        proposer=proposer)
    table = markdown_table(records)
    print(table)
    if args.out and args.out != "-":
        out = Path(args.out)
        path = out if out.suffix == ".json" else out / "vllm-bench.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1) + "\n")
        path.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {path}, {path.with_suffix('.md')}")
    return 0
