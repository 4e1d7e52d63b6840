"""Speed on batches: the same left-padded batches through ``model.generate`` and probe-mtp.

For each batch size B, the prompts are cut into batches of B (in order), and every batch is
decoded greedily by both, alternating which goes first; the speedup is the ratio of their summed
times, with a 95% interval from a bootstrap over the batches (paired: both sides of a resampled
batch come from the same run).  Tokens/s counts each row's generated tokens up to its end (its EOS
or the limit), not the padding after it.  Every batch size starts with an empty drafting memory
(the decoder keeps what it learns within that size's batches, as a long-running process would), so
no size drafts from the outputs of the same prompts decoded at another size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

BOOTSTRAP_ROUNDS = 2000
MAX_BATCH = 64


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``; every size an integer from 1 to :data:`MAX_BATCH`."""
    sizes = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            size = int(part)
        except ValueError:
            raise ValueError(f"--batch takes a comma list of batch sizes, e.g. 1,2,4,8; got {text!r}") from None
        if not 1 <= size <= MAX_BATCH:
            raise ValueError(f"--batch: batch sizes must lie in 1..{MAX_BATCH}, got {size}")
        sizes.append(size)
    if not sizes:
        raise ValueError(f"--batch takes a comma list of batch sizes, e.g. 1,2,4,8; got {text!r}")
    return tuple(dict.fromkeys(sizes))


def first_turn_ids(tokenizer, prompts) -> list[torch.Tensor]:
    """``[1, L]`` ids of every prompt's first turn (chat template where the tokenizer has one)."""
    from ..prompts import chat_input_ids

    return [chat_input_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]


@dataclass
class BatchRow:
    """One batch size's figures."""

    batch: int
    batches: int
    tokens: int
    generate_seconds: float
    probe_seconds: float
    low: float
    high: float
    tau: float
    identical: int

    @property
    def speedup(self) -> float:
        return self.generate_seconds / self.probe_seconds

    def as_dict(self) -> dict:
        return {"batch": self.batch, "batches": self.batches, "tokens": self.tokens,
                "generate_tokens_per_second": self.tokens / self.generate_seconds,
                "probe_tokens_per_second": self.tokens / self.probe_seconds, "speedup": self.speedup,
                "speedup_low": self.low, "speedup_high": self.high, "tau": self.tau, "identical": self.identical}


def left_padded(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P]`` ids and attention mask of 1-row id tensors, padded on the left."""
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1] :] = r[0]
        mask[i, width - r.shape[1] :] = 1
    return ids, mask


def generated_tokens(out: torch.Tensor, prompt_width: int, eos: set[int]) -> int:
    """Tokens each row generated up to and including its end."""
    total = 0
    for row in out[:, prompt_width:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        total += ends[0] + 1 if ends else len(row)
    return total


def bootstrap_interval(generate: np.ndarray, probe: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% interval of ``sum(generate) / sum(probe)`` over resampled batches."""
    if generate.size < 2:
        ratio = float(generate.sum() / probe.sum())
        return ratio, ratio
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, generate.size, size=(BOOTSTRAP_ROUNDS, generate.size))
    ratios = generate[picks].sum(axis=1) / probe[picks].sum(axis=1)
    return float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))


def measure_batches(model, decoder, prompt_ids: list[torch.Tensor], sizes: list[int], max_new_tokens: int,
                    pad_token_id: int | None = None, eos: set[int] | None = None, progress=None) -> list[BatchRow]:
    """Every batch size in ``sizes`` over the same prompts (see the module docstring).
    ``pad_token_id`` / ``eos``: default from the model's generation config (then the tokenizer's
    end-of-sequence token)."""
    if eos is None or pad_token_id is None:
        config_eos = model.generation_config.eos_token_id
        config_eos = [config_eos] if isinstance(config_eos, int) else list(config_eos or [])
        eos = set(config_eos) if eos is None else eos
        if pad_token_id is None:
            pad_token_id = model.generation_config.pad_token_id
            pad_token_id = pad_token_id if pad_token_id is not None else (config_eos[0] if config_eos else 0)
    too_big = [s for s in sizes if s > len(prompt_ids)]
    if too_big:
        raise ValueError(f"batch size {max(too_big)} needs at least {max(too_big)} prompts; there are {len(prompt_ids)} "
                         "(raise --limit)")
    rows = []
    for size in sizes:
        batches = [prompt_ids[i : i + size] for i in range(0, len(prompt_ids) - size + 1, size)]
        if not batches:
            raise ValueError(f"batch size {size} needs at least {size} prompts; there are {len(prompt_ids)}")
        warm_ids, warm_mask = left_padded(batches[0], pad_token_id)
        model.generate(warm_ids, attention_mask=warm_mask, do_sample=False, max_new_tokens=4, pad_token_id=pad_token_id)
        decoder.generate(warm_ids, attention_mask=warm_mask, max_new_tokens=4, pad_token_id=pad_token_id)
        if decoder.memory is not None:
            # every size decodes the same prompts: without this, a size would draft the outputs of
            # the sizes before it from the memory's corpus (a repeat stream, not a batch measurement)
            decoder.reset_memory()
        gen_times, probe_times, tokens, accepted, identical = [], [], 0, [], 0
        for j, batch in enumerate(batches):
            ids, mask = left_padded(batch, pad_token_id)
            kw = dict(attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
            timed = {}
            for who in (("generate", "probe") if j % 2 == 0 else ("probe", "generate")):
                t0 = time.perf_counter()
                if who == "generate":
                    result = model.generate(ids, do_sample=False, **kw)
                else:
                    result = decoder.generate(ids, return_dict_in_generate=True, **kw)
                timed[who] = (time.perf_counter() - t0, result)
            ref, out = timed["generate"][1], timed["probe"][1]
            identical += int(torch.equal(ref, out.sequences))
            tokens += generated_tokens(ref, ids.shape[1], eos)
            accepted += out.stats.accepted_lengths
            gen_times.append(timed["generate"][0])
            probe_times.append(timed["probe"][0])
            if progress is not None:
                progress(size, j + 1, len(batches))
        g, p = np.array(gen_times), np.array(probe_times)
        low, high = bootstrap_interval(g, p)
        tau = float(np.mean(accepted)) if accepted else 1.0
        rows.append(BatchRow(size, len(batches), tokens, float(g.sum()), float(p.sum()), low, high, tau, identical))
    return rows


def batch_sentence(rows: list[BatchRow]) -> str:
    """One line in words: the speedup at each batch size."""
    parts = [f"B={r.batch}: {r.speedup:.2f}x ({r.low:.2f}-{r.high:.2f}), identical {r.identical}/{r.batches}" for r in rows]
    return "default decoder on batches, against model.generate on the same batches: " + "; ".join(parts)


def rich_batch_table(rows: list[BatchRow], title: str):
    from rich.table import Table

    table = Table(title=title)
    for name in ("batch", "batches", "generate tok/s", "probe-mtp tok/s", "speedup", "95% interval", "tau", "identical"):
        table.add_column(name, justify="right")
    for r in rows:
        d = r.as_dict()
        colour = "green" if r.speedup > 1 else "default"
        table.add_row(str(r.batch), str(r.batches), f"{d['generate_tokens_per_second']:.1f}",
                      f"{d['probe_tokens_per_second']:.1f}", f"[{colour}]{r.speedup:.2f}x[/{colour}]",
                      f"{r.low:.2f}-{r.high:.2f}", f"{r.tau:.2f}", f"{r.identical}/{r.batches}")
    return table


def markdown_batch_table(rows: list[BatchRow]) -> str:
    lines = ["| batch | batches | generate tokens/s | probe-mtp tokens/s | speedup [95% interval] | tau | identical |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        d = r.as_dict()
        lines.append(f"| {r.batch} | {r.batches} | {d['generate_tokens_per_second']:.1f} | {d['probe_tokens_per_second']:.1f} | "
                     f"{r.speedup:.2f}x [{r.low:.2f}, {r.high:.2f}] | {r.tau:.2f} | {r.identical}/{r.batches} |")
    return "\n".join(lines) + "\n"
