"""Speed on batches: the same left-padded batches through ``model.generate`` and probe-mtp.

For each batch size B, the prompts are cut into batches of B (in order), and every batch is
decoded greedily by both, alternating which goes first; the speedup is the ratio of their summed
times, with a 95% interval from a bootstrap over the batches (paired: both sides of a resampled
batch come from the same run).  Tokens/s counts each row's generated tokens up to its end (its EOS
or the limit), not the padding after it.  Every batch size starts with an empty drafting memory
(the decoder keeps what it learns within that size's batches, as a long-running process would), so
no size drafts from the outputs of the same prompts decoded at another size.

With a float32 reference (``reference_model``: the unprepared model beside one prepared by
:func:`probe_mtp.optimize`), every batch is also decoded by ``reference_model.generate``, the three
in an order rotated from batch to batch, and each row adds the speedup over it with its interval
(the same bootstrap) and the batches where it gave what ``model.generate`` gave on the prepared model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .timing import wall_seconds

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
class Fp32Batches:
    """A batch size's figures of ``model.generate`` on the float32 reference model: its summed
    time, its own generated tokens, the 95% interval of probe-mtp's speedup over it, and the
    batches where its output equals ``model.generate``'s on the prepared model."""

    seconds: float
    tokens: int
    low: float
    high: float
    identical: int


@dataclass
class BatchRow:
    """One batch size's figures (``fp32``: against the float32 reference, None without one)."""

    batch: int
    batches: int
    tokens: int
    generate_seconds: float
    probe_seconds: float
    low: float
    high: float
    tau: float
    identical: int
    fp32: Fp32Batches | None = None

    @property
    def speedup(self) -> float:
        return self.generate_seconds / self.probe_seconds

    @property
    def speedup_vs_fp32(self) -> float | None:
        return self.fp32.seconds / self.probe_seconds if self.fp32 is not None else None

    def as_dict(self) -> dict:
        fp32 = self.fp32
        return {"batch": self.batch, "batches": self.batches, "tokens": self.tokens,
                "generate_tokens_per_second": self.tokens / self.generate_seconds,
                "probe_tokens_per_second": self.tokens / self.probe_seconds, "speedup": self.speedup,
                "speedup_low": self.low, "speedup_high": self.high, "tau": self.tau, "identical": self.identical,
                "fp32_tokens_per_second": fp32.tokens / fp32.seconds if fp32 else None,
                "speedup_vs_fp32": self.speedup_vs_fp32, "speedup_vs_fp32_low": fp32.low if fp32 else None,
                "speedup_vs_fp32_high": fp32.high if fp32 else None,
                "fp32_identical": fp32.identical if fp32 else None}


def left_padded(rows: list[torch.Tensor], pad: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P]`` ids and attention mask of 1-row id tensors, padded on the left, on ``device``
    (assembled on the host, moved once)."""
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(rows), width), dtype=torch.long, device="cpu")
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1] :] = r[0]
        mask[i, width - r.shape[1] :] = 1
    return ids.to(device), mask.to(device)


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
                    pad_token_id: int | None = None, eos: set[int] | None = None, progress=None,
                    reference_model=None) -> list[BatchRow]:
    """Every batch size in ``sizes`` over the same prompts (see the module docstring).
    ``pad_token_id`` / ``eos``: default from the model's generation config (then the tokenizer's
    end-of-sequence token).  ``reference_model``: also time its ``generate`` on every batch (the
    float32 model beside a prepared ``model``)."""
    generators = {"generate": model.generate}
    if reference_model is not None:
        generators["fp32"] = reference_model.generate
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
        warm_ids, warm_mask = left_padded(batches[0], pad_token_id, model.device)
        for generate in generators.values():
            generate(warm_ids, attention_mask=warm_mask, do_sample=False, max_new_tokens=4, pad_token_id=pad_token_id)
        decoder.generate(warm_ids, attention_mask=warm_mask, max_new_tokens=4, pad_token_id=pad_token_id)
        if decoder.memory is not None:
            # every size decodes the same prompts: without this, a size would draft the outputs of
            # the sizes before it from the memory's corpus (a repeat stream, not a batch measurement)
            decoder.reset_memory()
        times = {who: [] for who in (*generators, "probe")}
        tokens, fp32_tokens, accepted, identical, fp32_identical = 0, 0, [], 0, 0
        for j, batch in enumerate(batches):
            ids, mask = left_padded(batch, pad_token_id, model.device)
            kw = dict(attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
            timed = {}
            order = list(times)
            for who in order[j % len(order):] + order[: j % len(order)]:  # rotated from batch to batch
                if who == "probe":
                    result, seconds = wall_seconds(model.device, decoder.generate, ids, return_dict_in_generate=True, **kw)
                else:
                    result, seconds = wall_seconds(model.device, generators[who], ids, do_sample=False, **kw)
                times[who].append(seconds)
                timed[who] = result
            ref, out = timed["generate"], timed["probe"]
            identical += int(torch.equal(ref, out.sequences))
            tokens += generated_tokens(ref, ids.shape[1], eos)
            accepted += out.stats.accepted_lengths
            if "fp32" in timed:
                fp32_identical += int(torch.equal(ref, timed["fp32"]))
                fp32_tokens += generated_tokens(timed["fp32"], ids.shape[1], eos)
            if progress is not None:
                progress(size, j + 1, len(batches))
        g, p = np.array(times["generate"]), np.array(times["probe"])
        low, high = bootstrap_interval(g, p)
        tau = float(np.mean(accepted)) if accepted else 1.0
        fp32 = None
        if "fp32" in times:
            f = np.array(times["fp32"])
            fp32 = Fp32Batches(float(f.sum()), fp32_tokens, *bootstrap_interval(f, p), fp32_identical)
        rows.append(BatchRow(size, len(batches), tokens, float(g.sum()), float(p.sum()), low, high, tau, identical, fp32))
    return rows


def batch_sentence(rows: list[BatchRow]) -> str:
    """One line in words: the speedup at each batch size."""
    parts = [f"B={r.batch}: {r.speedup:.2f}x ({r.low:.2f}-{r.high:.2f}), identical {r.identical}/{r.batches}"
             + (f", {r.speedup_vs_fp32:.2f}x float32 model.generate ({r.fp32.low:.2f}-{r.fp32.high:.2f})" if r.fp32 else "")
             for r in rows]
    return "default decoder on batches, against model.generate on the same batches: " + "; ".join(parts)


def rich_batch_table(rows: list[BatchRow], title: str):
    from rich.table import Table

    table = Table(title=title)
    fp32 = any(r.fp32 for r in rows)
    for name in ("batch", "batches", "generate tok/s", *(("generate fp32 tok/s",) if fp32 else ()), "probe-mtp tok/s",
                 "speedup", "95% interval", *(("x generate fp32", "95% interval fp32") if fp32 else ()), "tau",
                 "identical"):
        table.add_column(name, justify="right")
    for r in rows:
        d = r.as_dict()
        colour = "green" if r.speedup > 1 else "default"
        rate, vs_fp32 = [], []
        if fp32:
            rate = [_fp32_rate(d)]
            vs_fp32 = [f"{r.speedup_vs_fp32:.2f}x", f"{r.fp32.low:.2f}-{r.fp32.high:.2f}"] if r.fp32 else ["-", "-"]
        table.add_row(str(r.batch), str(r.batches), f"{d['generate_tokens_per_second']:.1f}", *rate,
                      f"{d['probe_tokens_per_second']:.1f}", f"[{colour}]{r.speedup:.2f}x[/{colour}]",
                      f"{r.low:.2f}-{r.high:.2f}", *vs_fp32, f"{r.tau:.2f}", f"{r.identical}/{r.batches}")
    return table


def _fp32_rate(d: dict) -> str:
    rate = d["fp32_tokens_per_second"]
    return "-" if rate is None else f"{rate:.1f}"


def markdown_batch_table(rows: list[BatchRow]) -> str:
    fp32 = any(r.fp32 for r in rows)
    lines = ["| batch | batches | generate tokens/s | " + ("generate fp32 tokens/s | " if fp32 else "")
             + "probe-mtp tokens/s | speedup [95% interval] | " + ("x generate fp32 [95% interval] | " if fp32 else "")
             + "tau | identical |", "| --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if fp32 else "")]
    for r in rows:
        d = r.as_dict()
        rate = f" {_fp32_rate(d)} |" if fp32 else ""
        vs_fp32 = ""
        if fp32:
            vs_fp32 = f" {r.speedup_vs_fp32:.2f}x [{r.fp32.low:.2f}, {r.fp32.high:.2f}] |" if r.fp32 else " - |"
        lines.append(f"| {r.batch} | {r.batches} | {d['generate_tokens_per_second']:.1f} |{rate} "
                     f"{d['probe_tokens_per_second']:.1f} | {r.speedup:.2f}x [{r.low:.2f}, {r.high:.2f}] |{vs_fp32} "
                     f"{r.tau:.2f} | {r.identical}/{r.batches} |")
    return "\n".join(lines) + "\n"
