"""Host synchronisations per decoding step, and whether decoding runs under torch's default device
"meta" (a tensor made without a device then has no data): the two checks of GPU readiness that
need no GPU.

For each configuration (the default decoder greedy, a left-padded batch of four, seeded
sampling, ESP, PLD): the calls that would make the host wait for a device (``item``, ``tolist``,
``cpu``, ``numpy``, ``bool`` / ``int`` / ``float`` / ``index`` of a tensor) made by probe_mtp's
code, per step after the prefill (a generation's count less that of the same call for one token),
the busiest lines, and whether the same call under default device "meta" gives the same tokens.

    python scripts/host_syncs.py --model smollm2-135m --max-new-tokens 64
    PYTHONPATH=/path/to/other/checkout python scripts/host_syncs.py   # another version of probe_mtp
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import torch

import probe_mtp
from probe_mtp.prompts import balanced_subset, chat_input_ids, load_prompts
from probe_mtp.report.batches import left_padded


def audit_module():
    """This checkout's probe_mtp/device_audit.py, loaded by path (an older probe_mtp lacks it)."""
    path = Path(__file__).resolve().parent.parent / "probe_mtp" / "device_audit.py"
    spec = importlib.util.spec_from_file_location("probe_mtp_device_audit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per configuration (one per task)")
    ap.add_argument("--chained", action="store_true", help="count x.cpu().numpy() as two calls")
    args = ap.parse_args()
    audit = audit_module()
    package = os.path.dirname(probe_mtp.__file__)
    model, tok = probe_mtp.load_model(args.model)
    texts = [p.turns[0] for p in balanced_subset(load_prompts(), 1)][: args.prompts]
    prompts = [chat_input_ids(tok, [{"role": "user", "content": t}]) for t in texts]
    batch, mask = left_padded(prompts[:4], tok.pad_token_id)
    n = args.max_new_tokens
    configs = {
        "greedy, default decoder": [dict(input_ids=p) for p in prompts],
        "batch of 4, default decoder": [dict(input_ids=batch, attention_mask=mask)],
        "sampling (T=0.7), default decoder": [dict(input_ids=p, do_sample=True, temperature=0.7, seed=i)
                                              for i, p in enumerate(prompts)],
        "greedy, esp (k=2, BC 30)": [dict(input_ids=p, drafter="esp", num_masks=2, budget=30) for p in prompts],
        "greedy, pld": [dict(input_ids=p, drafter="pld") for p in prompts],
    }
    print(f"probe_mtp from {package}; {args.model}, {n} new tokens, torch {torch.__version__}")
    for name, calls in configs.items():
        syncs = steps = 0
        same = True
        sites = {}
        for call in calls:
            counts, result = [], None
            for tokens in (n, 1):
                kwargs = dict(call, max_new_tokens=tokens, return_dict_in_generate=True)
                seed = kwargs.pop("seed", None)
                if seed is not None:
                    kwargs["generator"] = torch.Generator(device=model.device).manual_seed(seed)
                decoder = probe_mtp.ProbeDecoder(model, tok, memory=False)
                with audit.HostSyncCounter(package=package, chained=args.chained) as counter:
                    out = decoder.generate(**kwargs)
                counts.append(counter)
                result = result or out
            syncs += counts[0].total - counts[1].total
            steps += result.stats.forward_passes - 1
            for site, c in counts[0].sites.items():
                sites[site] = sites.get(site, 0) + c - counts[1].sites.get(site, 0)
            if "do_sample" not in call:
                kwargs = dict(call, max_new_tokens=n)
                with audit.meta_default_device():
                    try:
                        meta = probe_mtp.ProbeDecoder(model, tok, memory=False).generate(**kwargs)
                        same = same and torch.equal(meta, result.sequences)
                    except Exception as exc:  # noqa: BLE001 - the audit reports any failure
                        same = f"fails: {type(exc).__name__}: {str(exc)[:80]}"
        busiest = ", ".join(f"{s} {c / steps:.1f}" for s, c in sorted(sites.items(), key=lambda kv: -kv[1])[:4] if c)
        meta_word = "n/a (sampled)" if any("do_sample" in c for c in calls) else ("identical" if same is True else same)
        print(f"{name:36s} {syncs / max(steps, 1):5.2f} per step over {steps} steps; meta: {meta_word}")
        print(f"{'':36s} busiest: {busiest}")


if __name__ == "__main__":
    main()
