"""One decoding step, as the algorithm reads:

    propose -> plan under the budget -> lay out the pass -> verify pass -> accept -> commit -> feed back

1. **propose**: the drafter proposes a token tree rooted at the last committed token;
2. **plan**: the budget policy cuts it to the size (and masks) that pays on this machine;
3. **lay out**: the tree's layout ``[root | nodes | masks]`` (cached per shape), embeddings, tree
   attention mask and depth-based position ids;
4. **verify pass**: one forward pass over the whole tree on top of the KV cache;
5. **accept**: the request's acceptance rule walks the tree with the model's own choices
   (greedy, sample-and-match or recursive rejection: lossless, :mod:`probe_mtp.acceptance`);
   the KV cache keeps the accepted path only;
6. **commit**: the accepted tokens and the bonus token, one at a time under the stopping criteria;
7. **feed back**: the drafter learns from every verified node and reads the masks of the deepest
   accepted node (they propose the next tree); the mask vectors take the new tokens in.

:func:`decode_step` is that pipeline; each stage is a function of the generation's state
(:class:`~probe_mtp.generation.Generation`).  :func:`prefill` is the first pass (the prompt and the
masks of its last token); :func:`run` is the loop.  The opt-in lossy ConfAdapt rule is a strategy of
its own (:mod:`probe_mtp.confadapt`) built from the same stages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .acceptance import Verdict
from .adaptive import StepPlan
from .drafters import StepFeedback
from .generation import Generation
from .heap import heap_trimmer
from .kv import attention_inputs, keep_accepted
from .passes import PassInputs, PassLogits, assemble_inputs, forward_pass
from .stats import GenerateOutput
from .tree import TokenTree, TreeLayout, prefill_layout
from .vocab import RowTops


def decode_step(gen: Generation) -> None:
    """One lossless step: propose -> plan -> lay out -> verify -> accept -> commit -> feed back."""
    tree = propose(gen)
    plan = gen.policy.plan(tree, gen.cached)
    layout, inputs = lay_out(gen, plan)
    logits = verify_pass(gen, plan.tree, layout, inputs)
    tops = node_tops(gen, logits.nodes)
    verdict = gen.accept(plan.tree, logits.nodes, gen.sequence[0], tops)
    gen.policy.observe(plan.tree, verdict.path)
    keep_accepted(gen.cache, layout.num_inputs, verdict.path)
    mask_logits = logits.masks_of(verdict.last) if plan.num_masks else None
    gen.stats.accepted_lengths.append(commit(gen, verdict.tokens, verdict.scores))
    feed_back(gen, plan.tree, verdict, logits.nodes, mask_logits, tops)


# ---------------------------------------------------------------------------------- stages
def propose(gen: Generation, node_cap: int | None = None) -> TokenTree:
    """The drafter's tree for the next pass (told first which scores cannot pay and, in a batch,
    how many nodes can fit its row's part of the pass)."""
    gen.drafter.min_score = gen.policy.score_floor()
    gen.drafter.node_cap = node_cap
    return gen.drafter.propose(gen.root, gen.host_context)


def lay_out(gen: Generation, plan: StepPlan) -> tuple[TreeLayout, PassInputs]:
    """The plan's layout (cached per tree shape) and the pass's inputs."""
    layout = gen.layout(plan.tree, plan.num_masks, plan.pad_to, plan.owners)
    parts = gen.parts
    masks = gen.masks if plan.num_masks else None
    return layout, assemble_inputs(parts.embed, plan.tree, layout, masks, gen.cached, gen.cache, parts.fmt)


def verify_pass(gen: Generation, tree: TokenTree, layout: TreeLayout, inputs: PassInputs) -> PassLogits:
    """One forward pass over ``tree`` (timed and counted); the nodes' logits and the masks' on demand."""
    clock = gen.clock
    start = clock.mark()
    logits = gen.parts.output.run(gen.cache, inputs, layout, tree.size)
    gen.pass_marks = (start, clock.mark())  # read by settle_timing, once the step has its results
    gen.stats.forward_passes += 1
    gen.stats.inputs_per_pass.append(layout.num_inputs)
    return logits


def settle_timing(gen: Generation) -> float:
    """The device time of the step's verify pass, added to the statistics (read after the step,
    when the device has finished the pass anyway: no wait of its own)."""
    if gen.pass_marks is None:
        return 0.0
    seconds = gen.clock.seconds(*gen.pass_marks)
    gen.pass_marks = None
    gen.stats.forward_seconds += seconds
    return seconds


def mask_tops(drafter, mask_logits: torch.Tensor | None) -> RowTops | None:
    """The most probable tokens of the masks that seed the next tree, as wide as the drafter
    reads them (None: no masks, or a drafter that reads none)."""
    width = drafter.mask_top_k
    if mask_logits is None or not width:
        return None
    return RowTops.of(mask_logits, width)


def node_tops(gen: Generation, node_logits: torch.Tensor) -> RowTops | None:
    """Every node's most probable tokens, once, when the drafter learns from them (the greedy walk
    reads their argmax too)."""
    width = tops_width(gen.drafter)
    return RowTops.of(node_logits, width) if width else None


def tops_width(drafter) -> int:
    """How many top tokens of every node to keep: the drafter's ``node_top_k``, at least two; 0 (a
    drafter that learns nothing from them): none."""
    width = drafter.node_top_k
    return max(width, 2) if width else 0


@dataclass
class Staged:
    """Tokens written after a row's committed ones but not yet committed (:func:`stage`): the
    ones that fit under the length limit, their score rows, and the stopping criteria's verdict
    after each of them, still on the device (None: the request has no criteria)."""

    tokens: np.ndarray
    scores: object
    stops: torch.Tensor | np.ndarray | None  # on the host already where the criteria allow it


def stage(gen: Generation, tokens, scores) -> Staged:
    """Write ``tokens`` after the committed ones and run the stopping criteria after each (on the
    device, nothing read back yet); ``scores[i]`` is token i's ``[1, V]`` score row."""
    req = gen.request
    fits = np.asarray(tokens, dtype=np.int64).reshape(-1)[: max(req.max_length - gen.length, 0)]
    gen.write(fits)
    stops = None
    if req.host_criteria is not None:
        stops = req.host_criteria.stops(fits, gen.length)
    elif req.criteria and fits.size:
        flags = []
        for i in range(fits.size):
            row = scores[i] if scores is not None else None
            stop = req.criteria(gen.buffer[:, : gen.length + i + 1], row)
            flags.append(torch.as_tensor(stop, device=gen.device).any().reshape(1))
        stops = torch.cat(flags)
    return Staged(fits, scores, stops)


def settle(gen: Generation, staged: Staged, stops: np.ndarray | None) -> int:
    """Commit the staged tokens up to and including the first one after which a stopping
    criterion held (``stops``: :attr:`Staged.stops` on the host); sets ``gen.done``.  Returns how
    many were committed."""
    req = gen.request
    count = staged.tokens.size
    stopped = stops is not None and bool(stops.any())
    if stopped:
        count = int(np.argmax(stops)) + 1
    if req.output_scores and staged.scores is not None:
        gen.scores.extend(staged.scores[i].clone() for i in range(count))
    gen.length += count
    if stopped or gen.length >= req.max_length:  # the buffer holds max_length tokens at least
        gen.done = True
    if count and req.streamer is not None:
        req.streamer.put(torch.from_numpy(gen.tokens[gen.length - count : gen.length].copy()))
    return count


def read_stops(staged: list[Staged]) -> list[np.ndarray | None]:
    """Every row's :attr:`Staged.stops` on the host, in one transfer."""
    flags = [s.stops for s in staged if isinstance(s.stops, torch.Tensor)]
    if not flags:
        return [s.stops for s in staged]
    host = torch.cat(flags).cpu().numpy()
    out, at = [], 0
    for s in staged:
        if not isinstance(s.stops, torch.Tensor):
            out.append(s.stops)
        else:
            out.append(host[at : at + s.stops.numel()])
            at += s.stops.numel()
    return out


def commit(gen: Generation, tokens, scores) -> int:
    """Append ``tokens``, as if one at a time under the stopping criteria (checked after each,
    read back once); ``scores[i]`` is token i's ``[1, V]`` score row.  Returns how many were
    committed; sets ``gen.done``."""
    staged = stage(gen, tokens, scores)
    return settle(gen, staged, read_stops([staged])[0])


def feed_back(gen: Generation, tree: TokenTree, verdict: Verdict, node_logits: torch.Tensor,
              mask_logits: torch.Tensor | None, tops: RowTops | None = None, is_prefill: bool = False,
              masks_top: RowTops | None = None) -> None:
    """The drafter learns from the pass; the mask vectors take the new tokens in.  ``masks_top``:
    :func:`mask_tops` of ``mask_logits`` when the caller computed them (a batch, for all rows
    at once); else they are computed here."""
    if masks_top is None:
        masks_top = mask_tops(gen.drafter, mask_logits)
    gen.drafter.observe(
        StepFeedback(
            tree=tree,
            accepted=verdict.path,
            new_tokens=verdict.tokens,
            node_logits=node_logits,
            mask_logits=mask_logits,
            context=gen.host_context,
            is_prefill=is_prefill,
            node_tops=tops,
            mask_tops=masks_top,
        )
    )
    if gen.masks is not None and not gen.done:
        gen.masks.update(gen.embed_tokens(verdict.tokens))


# ---------------------------------------------------------------------------------- prefill
@dataclass
class PrefillResult:
    root: TokenTree  # the root-only tree (the prompt's last token)
    verdict: Verdict
    node_logits: torch.Tensor  # [1, V]
    mask_logits: torch.Tensor | None  # [k, V]


def prefill_pass(gen: Generation) -> PrefillResult:
    """One pass over the prompt and k masks owned by its last token; the cache keeps the prompt."""
    parts, k = gen.parts, gen.drafter.num_masks
    prompt = gen.context
    n = prompt.shape[0]
    layout = prefill_layout(n, k)
    embeds = parts.embed(prompt)
    if k:
        embeds = torch.cat([embeds, gen.masks.vectors.to(embeds.dtype)], dim=0)
    positions = torch.tensor(layout.position_offsets, device=gen.device)
    attn = attention_inputs(gen.cache, layout.visible, positions, parts.fmt)
    logits = forward_pass(parts.model, gen.cache, PassInputs(embeds[None], attn, positions[None]), logits_to_keep=k + 1)
    gen.stats.forward_passes += 1
    keep_accepted(gen.cache, n + k, np.arange(n))
    root = TokenTree.root_only(gen.root)
    verdict = gen.accept(root, logits[:1], gen.sequence[0])
    return PrefillResult(root, verdict, logits[:1], logits[1:] if k else None)


def finish_prefill(gen: Generation, result: PrefillResult) -> None:
    """Stream the prompt, commit the prefill's token and feed the pass back."""
    if gen.request.streamer is not None:
        gen.request.streamer.put(torch.from_numpy(gen.tokens[: gen.length].copy()))
    commit(gen, result.verdict.tokens, result.verdict.scores)
    feed_back(gen, result.root, result.verdict, result.node_logits, result.mask_logits, is_prefill=True)


def prefill(gen: Generation) -> None:
    finish_prefill(gen, prefill_pass(gen))


# ---------------------------------------------------------------------------------- the loop
@dataclass(frozen=True)
class Strategy:
    """How a request is decoded: its first pass and its steps."""

    prefill: Callable[[Generation], None]
    step: Callable[[Generation], None]


LOSSLESS = Strategy(prefill, decode_step)


def run(gen: Generation, strategy: Strategy = LOSSLESS) -> GenerateOutput:
    """Prefill, then steps until a stopping criterion; each step's timings go to the budget policy."""
    t0 = time.perf_counter()
    stats = gen.stats
    gen.drafter.start(gen.host_context)
    if not gen.done:
        strategy.prefill(gen)
        stats.prefill_seconds = time.perf_counter() - t0
    trim_heap = heap_trimmer(gen.device)
    while not gen.done:
        started, forward_before, cached = time.perf_counter(), stats.forward_seconds, gen.cached
        strategy.step(gen)
        settle_timing(gen)
        if trim_heap is not None:
            trim_heap()
        gen.policy.observe_timing(stats.inputs_per_pass[-1], cached, stats.forward_seconds - forward_before,
                                  time.perf_counter() - started)
    if gen.request.streamer is not None:
        gen.request.streamer.end()
    stats.seconds = time.perf_counter() - t0
    return gen.result()
