"""A/B of an older probe-mtp against this one in ONE process, on one loaded model: per prompt turn of
the bench's stream, plain ``model.generate`` and each decoder, in an order rotated per turn; prints
``model.generate``'s total time over each decoder's (every output must equal greedy).

Separate ``probe-mtp bench`` runs of two checkouts differ by more than their code (the machine's
phase, how each loads the model); here both decoders share the process, the weights and the clock.

Set-up (the older code importable under another name; it uses relative imports only):

    git worktree add /tmp/old <commit>
    mkdir -p /tmp/pkgs && cp -r /tmp/old/probe_mtp /tmp/pkgs/probe_mtp_before
    rm -rf /tmp/pkgs/probe_mtp_before/tree && cp -r /tmp/old/tree /tmp/pkgs/probe_mtp_before/tree
    python docs/scripts/ab_in_one_process.py /tmp/pkgs
"""

import sys
import time

import torch

import probe_mtp
from probe_mtp.prompts import chat_input_ids
from probe_mtp.report.harness import ReportSettings, select_prompts
from probe_mtp.report.streams import build_stream

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "/tmp/pkgs")
import probe_mtp_before  # noqa: E402

torch.set_num_threads(2)
model, tok = probe_mtp.load_model()
settings = ReportSettings(limit=2)
stream = build_stream(select_prompts(settings), settings.stream)
before = probe_mtp_before.ProbeDecoder(model, tok)
main_default = probe_mtp.ProbeDecoder(model, tok)
main_cold = probe_mtp.ProbeDecoder(model, tok, memory=False, masks="prompt_mean")
runs = {
    "before": lambda ids: before.generate(ids, max_new_tokens=128, drafter="hybrid", budget="auto", num_masks=1, mask_seed=0),
    "main": lambda ids: main_default.generate(ids, max_new_tokens=128),
    "main-cold-untuned": lambda ids: main_cold.generate(ids, max_new_tokens=128),
    "plain": lambda ids: model.generate(ids, do_sample=False, max_new_tokens=128),
}
names = list(runs)
warm_up = chat_input_ids(tok, [{"role": "user", "content": stream[0].turns[0].text}])
with torch.no_grad():
    for run in runs.values():
        run(warm_up)
main_default.reset_memory()
total = {name: 0.0 for name in names}
slot = 0
with torch.no_grad():
    for conversation in stream:
        history = []
        for item in conversation.turns:
            messages = history + [{"role": "user", "content": item.text}]
            ids = chat_input_ids(tok, messages)
            order = names[slot % len(names):] + names[: slot % len(names)]
            slot += 1
            outs = {}
            for name in order:
                t0 = time.perf_counter()
                outs[name] = runs[name](ids)
                total[name] += time.perf_counter() - t0
            for name in names:
                assert torch.equal(outs[name], outs["plain"]), name
            answer = tok.decode(outs["plain"][0, ids.shape[1]:], skip_special_tokens=True)
            history = messages + [{"role": "assistant", "content": answer}]
            print(conversation.task, item.turn, {n: round(total["plain"] / total[n], 3) for n in names}, flush=True)
print("final", {n: round(total["plain"] / total[n], 3) for n in names}, {n: round(s, 1) for n, s in total.items()})
