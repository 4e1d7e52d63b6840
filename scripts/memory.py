"""Process memory of a model in float32 and prepared by ``dtype="auto"``, each in a fresh process.

Three ways: float32, ``dtype="auto"`` (loaded in bf16 and prepared), and a float32 model in use
then prepared by ``probe_mtp.optimize`` (the peak while preparing).  For each: the resident memory
after loading, the peak while loading (and preparing), the
peak over one ``model.generate`` and then over one ``probe_mtp.generate`` of 128 tokens (the
high-water mark reset before each), and the resident memory after forward passes over many prompt
lengths (1 to --lengths tokens: kernels that keep state per input shape grow here).  Resident
memory counts the file pages of a memory-mapped float32 copy as they are read.

    python scripts/memory.py --model smollm2-135m --threads 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PROMPT = "Write a short story about a robot who learns to paint, in five sentences."


def measure(model_name: str, dtype: str, lengths: int, threads: int) -> dict:
    """Runs in the child process: one model, one dtype."""
    import ctypes
    import resource

    import torch

    import probe_mtp
    from probe_mtp.optimize import weight_bytes

    torch.set_num_threads(threads)

    def resident() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 / 2**20

    def high_water() -> float:
        """Peak resident memory since the start or the last reset_high_water() (VmHWM)."""
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def reset_high_water() -> None:
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # resets the peak to the present resident memory (Linux)
        except OSError:
            pass

    def trim() -> None:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass

    start = resident()
    model, tok = probe_mtp.load_model(model_name, dtype="auto" if dtype == "auto" else torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    if dtype == "optimize":  # a float32 model in use (its pages read), then prepared in place
        with torch.no_grad():
            model.generate(ids, max_new_tokens=16, do_sample=False)
        reset_high_water()
        probe_mtp.optimize(model)
    trim()
    row = {"dtype": probe_mtp.describe(model), "start": start, "loaded": resident(), "peak_load": high_water()}
    if dtype == "optimize":
        row["dtype"] = "float32 in use, then optimize(): " + row["dtype"]
    with torch.no_grad():
        reset_high_water()
        model.generate(ids, max_new_tokens=128, do_sample=False)
        row["peak_generate"] = high_water()
        reset_high_water()
        probe_mtp.generate(model, ids, max_new_tokens=128)
        row["peak_probe"] = high_water()
        for n in range(1, lengths + 1):
            model(torch.randint(10, 1000, (1, n)))
    trim()
    row["after_lengths"] = resident()
    row["weight_mb"] = weight_bytes(model) / 2**20
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, default=300, help="forward passes over prompts of 1..N tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["float32", "auto", "optimize"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.child, args.lengths, args.threads)))
        return
    rows = []
    for dtype in ("float32", "auto", "optimize"):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--lengths", str(args.lengths),
                              "--threads", str(args.threads), "--child", dtype],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    from probe_mtp.kernels import processor

    print(f"{args.model}, {processor().describe()}, {args.threads} threads, resident memory of the process, MB\n")
    print("| dtype | weights | after loading | peak while loading (preparing) | peak, model.generate | peak, probe-mtp "
          f"| after prompts of 1-{args.lengths} tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['dtype']} | {row['weight_mb']:.1f} | {row['loaded']:.0f} | {row['peak_load']:.0f} | "
              f"{row['peak_generate']:.0f} | {row['peak_probe']:.0f} | {row['after_lengths']:.0f} |")


if __name__ == "__main__":
    main()
