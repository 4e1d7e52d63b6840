"""Peak memory of one long generation, ``model.generate`` against probe-mtp, each in a fresh process.

Resident memory (RSS, from ``/proc/self/statm``) is sampled every few milliseconds by a thread
while the generation runs.  Each method runs in its own process, so memory freed by one cannot be
reused by the next.  Reported: RSS before the generation, its peak during it, the growth of the peak
over the second half of the generation (where only the KV cache should grow), and the steady
growth: the median RSS over the last tenth of the generation minus that over the first tenth
(transient spikes of single passes do not count), and the floor growth: the same with the lowest
RSS of each tenth, the memory still resident between passes.  When the passes grow over a
generation (repetitive text lets the adaptive budget verify 64-input trees), the median rises
with the memory held during a pass; the floor shows what is kept.

Run as ``python -m probe_mtp.report.memory --method esp --tokens 1024 --dtype auto``;
``compare_memory`` runs it for several methods and collects the JSON lines.  The model is loaded as
the run loaded it (``--dtype``: ``auto`` prepares it by :func:`probe_mtp.optimize` where the
processor has bf16 matrix units), so a prepared run measures the prepared model; each result names
the kernels it ran on.

MKL (torch's CPU BLAS) keeps a cache of work buffers for large matrix products and never returns
it: after one output-layer product of 63 or more rows on Gemma 3's 262k-token vocabulary, 67-210 MB
stay resident for the life of the process.  ``model.generate`` multiplies one row at a time and
never fills it; a 64-input tree pass does.  ``MKL_DISABLE_FAST_MM=1`` turns the cache off (no
measurable cost in our timings), but MKL reads it only when torch is imported, so it must be set
before Python starts.  ``compare_memory`` sets it in the measured processes, for ``generate`` and
the methods alike, unless told to keep MKL's default (``mkl_cache=True``) or the variable is
already set; each result records the value in force.

Loading a GGUF model leaves freed heap pages resident (for Gemma 3 we saw 50 to 280 MB, differing
from run to run), and probe-mtp's decoding hands freed pages back (``probe_mtp.heap``) while
``model.generate`` does not, so after the warm-up both processes trim the heap once (glibc): RSS
before the generation is then the same for both, and the peaks compare the generations rather than
the loader's leftovers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

MKL_CACHE_SWITCH = "MKL_DISABLE_FAST_MM"
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


class RssSampler:
    def __init__(self, every: float = 0.005):
        self.every = every
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), rss_bytes()))
            time.sleep(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def measure(model_name: str, method: str, tokens: int, threads: int | None, loaded=None,
            dtype="float32") -> dict:
    """One generation of ``tokens`` tokens by ``method`` (``"generate"`` or a drafter name), RSS
    sampled throughout; ``loaded``: the (model, tokenizer) already loaded, else loaded here in
    ``dtype`` (a torch dtype, its name, or ``"auto"``)."""
    import torch

    from ..loading import load_model
    from ..decoder import ProbeDecoder
    from ..heap import heap_trimmer
    from ..optimize import describe
    from ..options import parse_dtype
    from ..prompts import balanced_subset, chat_input_ids, load_prompts

    if threads:
        torch.set_num_threads(threads)
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    model, tok = loaded if loaded is not None else load_model(model_name, dtype=dtype)
    prompt = balanced_subset(load_prompts(), 1, ("mt_bench",))[0]
    ids = chat_input_ids(tok, [{"role": "user", "content": prompt.turns[0]}])
    decoder = ProbeDecoder(model, tok)
    with torch.no_grad():  # warm-up (allocator, cost curve) outside the measurement
        if method == "generate":
            model.generate(ids, do_sample=False, max_new_tokens=8)
        else:
            decoder.generate(ids, max_new_tokens=8, drafter=method, budget="auto")
    trim = heap_trimmer(torch.device("cpu"), every=1)  # the loader's freed pages, for both methods
    if trim is not None:
        trim()
    before = rss_bytes()
    start = time.perf_counter()
    with torch.no_grad(), RssSampler() as sampler:
        if method == "generate":
            # min_new_tokens: the whole length runs, EOS or not
            out = model.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)
        else:
            out = decoder.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, drafter=method, budget="auto")
    end = time.perf_counter()
    samples = sampler.samples or [(end, rss_bytes())]
    mid = start + (end - start) / 2
    first_half = [r for t, r in samples if t <= mid] or [samples[0][1]]
    second_half = [r for t, r in samples if t > mid] or [samples[-1][1]]
    tenth = max(1, len(samples) // 10)
    first_tenth = sorted(r for _, r in samples[:tenth])
    last_tenth = sorted(r for _, r in samples[-tenth:])
    return {
        "method": method,
        "kernels": describe(model),
        "new_tokens": int(out.shape[1] - ids.shape[1]),
        "rss_before_mb": before / 2**20,
        "peak_mb": max(r for _, r in samples) / 2**20,
        "peak_growth_mb": (max(r for _, r in samples) - before) / 2**20,
        "second_half_growth_mb": (max(second_half) - max(first_half)) / 2**20,
        "steady_growth_mb": (last_tenth[len(last_tenth) // 2] - first_tenth[len(first_tenth) // 2]) / 2**20,
        "floor_growth_mb": (last_tenth[0] - first_tenth[0]) / 2**20,
        "samples": len(samples),
        "seconds": end - start,
        MKL_CACHE_SWITCH: os.environ.get(MKL_CACHE_SWITCH),
    }


def compare_memory(model_name: str, methods: list[str], tokens: int, threads: int | None = None,
                   mkl_cache: bool = False, dtype: str = "float32") -> list[dict]:
    """Run :func:`measure` for ``generate`` and each method, each in a fresh Python process, the
    model loaded in ``dtype`` (a ``--dtype`` name: ``auto``, ``float32``, ...; with MKL's buffer
    cache off unless ``mkl_cache``; see the module docstring)."""
    env = dict(os.environ)
    if not mkl_cache:
        env.setdefault(MKL_CACHE_SWITCH, "1")
    results = []
    for method in ["generate", *methods]:
        cmd = [sys.executable, "-m", "probe_mtp.report.memory", "--model", model_name, "--method", method,
               "--tokens", str(tokens), "--dtype", str(dtype).removeprefix("torch.")]
        if threads:
            cmd += ["--threads", str(threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"memory measurement of {method} failed:\n{done.stderr[-2000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="generate", help="generate, or a probe-mtp drafter name")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32", help="auto, float32, bfloat16 or float16 (default float32)")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.model, args.method, args.tokens, args.threads, dtype=args.dtype)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
