"""Batched decoding: every row of a batch drafts its own tree, and one forward pass per step verifies
all of them.

A step reads as the single-row one (:mod:`probe_mtp.step`), with the pass shared:

    propose (each row) -> plan the batch -> lay out the rows side by side -> one verify pass
      -> accept (each row) -> keep each row's path in the ragged cache -> commit and feed back (each row)

Rows are laid out along the batch dimension, each padded to the widest row's inputs (padding inputs
see only themselves and are dropped).  Rows hold different numbers of tokens, so the KV cache is
ragged (:mod:`probe_mtp.ragged`): per-row position ids and a per-row 4D attention mask over shared
slots, sliding windows applied by the mask on positions.  The adaptive budget sizes the pass from
the cost of all its inputs (:func:`probe_mtp.adaptive.plan_batch`), shrinking the trees as the batch
grows.  A row that finishes (EOS, a stop string, its length limit) leaves the batch.  The prompts
are prefilled in one pass over the left-padded batch, or one pass per row where the cost curve
says the padding costs more (:func:`prefill_apart`).

Each row is a :class:`~probe_mtp.generation.Generation` (its committed tokens with the row's left
padding, its drafter, mask vectors, acceptance rule and statistics), so acceptance, stopping
criteria and logits processors work per row exactly as for one sequence.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .adaptive import AdaptiveBudget, BatchWidthCosts, StepPlan, laggard_weights, plan_batch
from .generation import Generation
from .heap import heap_trimmer
from .kv import new_cache
from .passes import PassInputs
from .ragged import RaggedCache
from .stats import DecodeStats, GenerateOutput
from .clock import DeviceClock
from .step import Staged, feed_back, propose, read_stops, settle, stage, tops_width
from .tree import TokenTree, TreeLayout, prefill_layout
from .vocab import RowTops


BARE_WARMUP = 8  # drafting steps before a bare one may skip drafting
MAX_SKIP = 8  # steps skipped at most between two drafting steps


class KeptLogits:
    """The logits a batched pass kept, in one float32 ``[M, V]`` tensor: every row's node inputs
    first, row after row (``node_block``: one block, reduced over the vocabulary at once), then
    every row's other kept inputs (its mask slots).  ``nodes(r)`` / ``extra(r)`` are views."""

    def __init__(self, flat: torch.Tensor, node_counts: list[int], extra_counts: list[int]):
        self.flat = flat
        self.node_ends = np.cumsum([0] + list(node_counts))
        self.extra_ends = self.node_ends[-1] + np.cumsum([0] + list(extra_counts))

    @classmethod
    def of(cls, rows: list[torch.Tensor], node_counts: list[int], output_layer=None) -> KeptLogits:
        """From each row's kept inputs (its nodes first), reordered into one block: their logits
        ``[keep_r, V]``, or their final hidden states ``[keep_r, H]`` with the ``output_layer`` that
        turns the block into float32 logits in one call."""
        block = torch.cat([x[:c] for x, c in zip(rows, node_counts)] + [x[c:] for x, c in zip(rows, node_counts)])
        flat = block.float() if output_layer is None else output_layer(block)
        return cls(flat, node_counts, [x.shape[0] - c for x, c in zip(rows, node_counts)])

    @property
    def node_block(self) -> torch.Tensor:
        return self.flat[: self.node_ends[-1]]

    def nodes(self, row: int) -> torch.Tensor:
        return self.flat[self.node_ends[row] : self.node_ends[row + 1]]

    def extra(self, row: int) -> torch.Tensor:
        return self.flat[self.extra_ends[row] : self.extra_ends[row + 1]]


class Batch:
    """The rows of one batched generation and what they share: the model's parts, the ragged KV
    cache, the mask format (``layer_types``: the model's attention types; ``window``: its sliding
    window), the measured cost of its passes by width (``widths``) and the batch's pass statistics."""

    def __init__(self, rows: list[Generation], cache: RaggedCache, layer_types: tuple[str, ...], window: int | None,
                 widths: BatchWidthCosts | None = None):
        self.rows = rows
        self.parts = rows[0].parts
        self.cache = cache
        self.layer_types = layer_types
        self.window = window
        self.active = [i for i, g in enumerate(rows) if not g.done]
        # after a bare step (no row's tree paid) drafting is skipped for `backoff` steps, then tried
        # again (1, 2, 4, 8 steps), once the first steps have taught the budget what trees are worth:
        # a batch too large for trees to pay decodes almost as plainly as model.generate
        self.skipped = 0
        self.backoff = 0
        self.drafted = 0
        # what batched passes cost by width, measured (the decoder's, shared by its batches); None:
        # priced by the cost curve alone
        self.widths = widths
        self.clock = DeviceClock(self.device)
        self.stats = DecodeStats(method=rows[0].stats.method, budget=rows[0].stats.budget,
                                 num_masks=rows[0].stats.num_masks, masks=rows[0].stats.masks, memory=rows[0].stats.memory)

    @property
    def device(self) -> torch.device:
        return self.rows[0].device

    def attention(self, visible: torch.Tensor, positions: torch.Tensor, cache: RaggedCache | None = None):
        """The pass's ``attention_mask`` over ``cache`` (default: the batch's): one 4D tensor when
        the model's layers share one attention type, else the per-layer-type mapping."""
        masks = (cache or self.cache).masks(visible, positions, self.window)
        fmt = self.parts.fmt
        finished = {kind: fmt.finish(masks[kind]) for kind in self.layer_types}
        return finished[self.layer_types[0]] if len(self.layer_types) == 1 else finished

    def forward(self, inputs: PassInputs, keep: list[int] | int, nodes: list[int] | int = 1,
                cache: RaggedCache | None = None) -> KeptLogits:
        """One pass over ``cache`` (default: the batch's); the float32 logits of each row's first
        ``keep[r]`` inputs (an int: the last ``keep`` inputs of every row), of which the first
        ``nodes[r]`` are tree nodes (see :class:`KeptLogits`)."""
        output = self.parts.output
        head = output.head
        kwargs = dict(inputs_embeds=inputs.inputs_embeds, attention_mask=inputs.attention_mask,
                      position_ids=inputs.position_ids, cache=(cache or self.cache).cache, use_cache=True)
        rows, n = inputs.inputs_embeds.shape[:2]
        spans = [(n - keep, n)] * rows if isinstance(keep, int) else [(0, c) for c in keep]
        counts = [nodes] * rows if isinstance(nodes, int) else list(nodes)
        if head is None:
            logits = self.parts.model(**kwargs).logits
            return KeptLogits.of([logits[r, a:b] for r, (a, b) in enumerate(spans)], counts)
        hidden = head.batch_hidden_states(**kwargs)
        # all rows' wanted positions through the output layer at once (nodes first, so that they
        # are one block for the vocabulary reductions), padded to the row count that costs least
        # (as for one row: BLAS can take twice as long over 8 rows as over 16)
        return KeptLogits.of([hidden[r, a:b] for r, (a, b) in enumerate(spans)], counts, output.logits)

    def drop_finished(self) -> None:
        still = [j for j, i in enumerate(self.active) if not self.rows[i].done]
        if len(still) < len(self.active):
            if still:
                self.cache.select(still)
            self.active = [self.active[j] for j in still]


def batch_prefill(batch: Batch) -> None:
    """The rows' prompts and the k masks of each last token, into the ragged cache: in one pass over
    the left-padded prompts, or row by row when the padding would cost more than the extra passes
    (:func:`prefill_apart`: prompts of very different lengths on a machine whose passes cost in
    proportion to their inputs)."""
    rows = [batch.rows[i] for i in batch.active]
    k = rows[0].drafter.num_masks
    length = rows[0].prompt_len  # the padded prompt length, the same for every row
    clock = batch.clock
    start = clock.mark()
    if prefill_apart(rows, k):
        logits = prefill_rows_apart(batch, rows, k, length)
    else:
        logits = prefill_padded(batch, rows, k, length)
    end = clock.mark()
    batch.cache.prefill([g.offset for g in rows], length + k, length)
    roots, verdicts = [], []
    for g, (root_logits, _) in zip(rows, logits):
        g.stats.forward_passes += 1
        roots.append(TokenTree.root_only(g.root))
        verdicts.append(g.accept(roots[-1], root_logits, g.sequence[0]))
    node_logits = [root_logits for root_logits, _ in logits]
    mask_logits = [masks if k else None for _, masks in logits]
    commit_rows(rows, roots, verdicts, node_logits, mask_logits, [None] * len(rows), is_prefill=True)
    batch.stats.forward_seconds += clock.seconds(start, end)
    batch.drop_finished()


def commit_rows(rows: list[Generation], trees: list[TokenTree], verdicts, node_logits, mask_logits, tops,
                is_prefill: bool = False) -> list[int]:
    """Commit every row's verdict and feed its pass back: the stopping criteria of all rows and
    the seeding masks' top tokens of all rows each come back from the device in one transfer.
    Returns the tokens each row committed."""
    staged: list[Staged] = [stage(g, v.tokens, v.scores) for g, v in zip(rows, verdicts)]
    seeds = batch_mask_tops(rows, mask_logits)
    committed = []
    for g, tree, verdict, nodes, masks, top, seed, st, stops in zip(rows, trees, verdicts, node_logits, mask_logits,
                                                                    tops, seeds, staged, read_stops(staged)):
        committed.append(settle(g, st, stops))
        feed_back(g, tree, verdict, nodes, masks, top, is_prefill=is_prefill, masks_top=seed)
    return committed


def batch_mask_tops(rows: list[Generation], mask_logits: list[torch.Tensor | None]) -> list[RowTops | None]:
    """Every row's :func:`~probe_mtp.step.mask_tops`, from one reduction over all rows' mask logits."""
    width = max(g.drafter.mask_top_k for g in rows)
    present = [i for i, m in enumerate(mask_logits) if m is not None]
    out: list[RowTops | None] = [None] * len(rows)
    if not width or not present:
        return out
    tops = RowTops.of(torch.cat([mask_logits[i] for i in present]), width)
    for i, block in zip(present, tops.split([mask_logits[i].shape[0] for i in present])):
        out[i] = block
    return out


def prefill_apart(rows: list[Generation], k: int) -> bool:
    """Whether prefilling each row's own prompt in a pass of its own costs less, on the lead row's
    cost curve, than one pass over every row padded to the longest prompt.  Padding is free on a
    machine whose passes cost the same at any width (a GPU's short prompts) and a row's pass is
    dear when it is narrow; on a CPU a pass costs in proportion to its inputs, and a batch mixing
    a 40-token question with a 900-token document would spend most of its prefill on padding.
    Fixed budgets keep the one padded pass."""
    lead = rows[0].policy
    if len(rows) == 1 or not isinstance(lead, AdaptiveBudget):
        return False
    length = rows[0].prompt_len
    apart = sum(lead.curve.cost(length - g.offset + k) for g in rows)
    return apart < lead.curve.cost(len(rows) * (length + k))


def row_prefill_inputs(batch: Batch, g: Generation, k: int, length: int, start: int):
    """Row ``g``'s prefill inputs: the embeddings of its buffer from ``start`` to ``length`` then
    its k masks, and the positions and visibility of its own prompt (from its offset) and masks."""
    embeds = batch.parts.embed(g.buffer[:, start:length])
    if k:
        embeds = torch.cat([embeds, g.masks.vectors[None].to(embeds.dtype)], dim=1)
    layout = prefill_layout(length - g.offset, k)
    positions = torch.tensor(layout.position_offsets, device=batch.device)
    visible = torch.tensor(layout.visible, device=batch.device)
    return embeds, positions, visible


def prefill_padded(batch: Batch, rows: list[Generation], k: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One pass over the left-padded prompts and masks; each row's logits of its last input
    ``[1, V]`` and of its k masks ``[k, V]``."""
    total = length + k
    embeds, positions = [], torch.zeros((len(rows), total), dtype=torch.long, device=batch.device)
    visible = torch.zeros((len(rows), total, total), dtype=torch.bool, device=batch.device)
    for r, g in enumerate(rows):
        row_embeds, row_positions, row_visible = row_prefill_inputs(batch, g, k, length, 0)
        embeds.append(row_embeds)
        positions[r, g.offset :], visible[r, g.offset :, g.offset :] = row_positions, row_visible
        visible[r, : g.offset, : g.offset] = torch.eye(g.offset, dtype=torch.bool, device=batch.device)  # padding sees itself only
    batch.stats.forward_passes += 1
    logits = batch.forward(PassInputs(torch.cat(embeds), batch.attention(visible, positions), positions), keep=k + 1)
    return [(logits.nodes(r), logits.extra(r)) for r in range(len(rows))]


def prefill_rows_apart(batch: Batch, rows: list[Generation], k: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A pass per row over its own prompt and masks, each into a cache of its own whose prompt
    entries are then copied into the row's slots of the batch's cache (after its left padding, as
    the padded pass would have written them); as :func:`prefill_padded`, each row's logits."""
    logits = []
    for r, g in enumerate(rows):
        n = length - g.offset
        embeds, positions, visible = row_prefill_inputs(batch, g, k, length, g.offset)
        alone = RaggedCache(new_cache(batch.parts.model, capacity=n + k, every_layer=True), 1, n + k, batch.device)
        kept = batch.forward(PassInputs(embeds, batch.attention(visible[None], positions[None], alone), positions[None]),
                             keep=k + 1, cache=alone)
        logits.append((kept.nodes(0), kept.extra(0)))
        batch.stats.forward_passes += 1
        batch.cache.write_row(r, g.offset, alone.cache, n)
    return logits


def batch_step(batch: Batch) -> None:
    """propose -> plan the batch -> lay out -> one verify pass -> accept -> keep -> commit -> feed back."""
    rows = [batch.rows[i] for i in batch.active]
    if batch.skipped < batch.backoff:
        batch.skipped += 1
        plans = [StepPlan(TokenTree.root_only(g.root), 0) for g in rows]
        for g in rows:
            g.drafter.skip_proposal()
    else:
        cap = batch_node_cap(rows)
        trees = [propose(g, cap) for g in rows]
        plans = plan_batch([g.policy for g in rows], trees, [g.cached for g in rows], batch.widths, row_weights(rows))
        batch.drafted += 1
        bare = all(p.num_inputs == 1 for p in plans) and batch.drafted > BARE_WARMUP
        batch.skipped, batch.backoff = 0, (min(max(2 * batch.backoff, 1), MAX_SKIP) if bare else 0)
    layouts, inputs = lay_out_batch(batch, rows, plans)
    clock = batch.clock
    start = clock.mark()
    logits = batch.forward(inputs, keep=[layout.num_inputs for layout in layouts], nodes=[p.tree.size for p in plans])
    end = clock.mark()
    batch.stats.forward_passes += 1
    batch.stats.inputs_per_pass.append(int(inputs.inputs_embeds.shape[0] * inputs.inputs_embeds.shape[1]))
    accepted = []
    for r, (g, plan, tops) in enumerate(zip(rows, plans, batch_node_tops(rows, logits))):
        nodes = logits.nodes(r)
        verdict = g.accept(plan.tree, nodes, g.sequence[0], tops)
        g.policy.observe(plan.tree, verdict.path)
        accepted.append((verdict, nodes, tops, g.cached + plan.tree.depths[verdict.path]))
    batch.cache.keep(inputs.inputs_embeds.shape[1], [a[0].path for a in accepted], [a[3] for a in accepted])
    mask_logits = []
    for r, (g, plan, layout, (verdict, _, _, _)) in enumerate(zip(rows, plans, layouts, accepted)):
        g.stats.forward_passes += 1
        g.stats.inputs_per_pass.append(layout.num_inputs)
        slots = layout.mask_slots(verdict.last) if plan.num_masks else np.zeros(0, dtype=np.int64)
        mask_logits.append(logits.extra(r)[torch.from_numpy(slots - plan.tree.size).to(batch.device)] if slots.size else None)
    committed = commit_rows(rows, [p.tree for p in plans], [a[0] for a in accepted], [a[1] for a in accepted],
                            mask_logits, [a[2] for a in accepted])
    for g, count in zip(rows, committed):
        g.stats.accepted_lengths.append(count)
    seconds = clock.seconds(start, end)  # the device is past the pass: its results were read
    batch.stats.forward_seconds += seconds
    if batch.widths is not None:
        batch.widths.observe(len(rows), int(inputs.inputs_embeds.shape[1]), seconds)
    batch.drop_finished()


def batch_node_cap(rows: list[Generation]) -> int | None:
    """The most draft nodes a row's tree can use: a row's part of the widest pass the budget may
    plan less its root; growing more is wasted work (None: no cap, fixed budgets verify whole
    trees)."""
    lead = rows[0].policy
    if not isinstance(lead, AdaptiveBudget):
        return None
    return lead.row_width_limit(len(rows)) - 1


def row_weights(rows: list[Generation]) -> np.ndarray:
    """What a drafted token of each row is worth to the batch (:func:`~probe_mtp.adaptive.laggard_weights`):
    each row's passes left (tokens left before its length limit over its tokens per pass so far),
    and one row's share of a bare pass's cost on the lead row's curve."""
    lead = rows[0].policy
    if len(rows) == 1 or not isinstance(lead, AdaptiveBudget):  # fixed budgets: plan_batch reads no weights
        return np.ones(len(rows))
    left = np.array([(g.request.max_length - g.length) * max(1, g.stats.forward_passes) / max(1, g.length - g.prompt_len)
                     for g in rows], dtype=np.float64)
    context = max(g.cached for g in rows)
    bare, one = lead.batch_pass_cost(len(rows), context), lead.batch_pass_cost(1, context)
    return laggard_weights(left, max(bare - one, 0.0) / (len(rows) - 1) / bare)


def batch_node_tops(rows: list[Generation], logits: KeptLogits) -> list[RowTops | None]:
    """Every row's :func:`~probe_mtp.step.node_tops`, from one reduction over all rows' nodes."""
    width = tops_width(rows[0].drafter)
    if not width:
        return [None] * len(rows)
    return RowTops.of(logits.node_block, width).split(np.diff(logits.node_ends))


def lay_out_batch(batch: Batch, rows: list[Generation], plans) -> tuple[list[TreeLayout], PassInputs]:
    """Every row's layout, side by side along the batch dimension and padded to the widest."""
    layouts = [g.layout(p.tree, p.num_masks, 0, p.owners) for g, p in zip(rows, plans)]
    width = max(layout.num_inputs for layout in layouts)
    device = batch.device
    ids = np.empty((len(rows), width), dtype=np.int64)
    positions = np.empty((len(rows), width), dtype=np.int64)
    visible = np.zeros((len(rows), width, width), dtype=bool)
    for r, (g, plan, layout) in enumerate(zip(rows, plans, layouts)):
        n, size = layout.num_inputs, plan.tree.size
        ids[r, :size] = plan.tree.tokens
        ids[r, size:] = plan.tree.tokens[0]  # mask slots (replaced below) and padding repeat the root
        positions[r, :n] = g.cached + layout.position_offsets
        positions[r, n:] = g.cached
        visible[r, :n, :n] = layout.visible
        visible[r, np.arange(n, width), np.arange(n, width)] = True
    embeds = batch.parts.embed(torch.from_numpy(ids).to(device))
    for r, (g, plan, layout) in enumerate(zip(rows, plans, layouts)):
        if plan.num_masks:
            slots = np.arange(plan.tree.size, layout.num_inputs)
            which = torch.from_numpy(layout.mask_index[slots] - 1).to(device)
            embeds[r, plan.tree.size : layout.num_inputs] = g.masks.vectors.index_select(0, which).to(embeds.dtype)
    positions_t = torch.from_numpy(positions).to(device)
    attention = batch.attention(torch.from_numpy(visible).to(device), positions_t)
    return layouts, PassInputs(embeds, attention, positions_t)


def run_batch(batch: Batch, pad_token_id: int | None) -> GenerateOutput:
    """Prefill, then batched steps until every row has stopped; the rows' sequences padded with
    ``pad_token_id`` after their ends, as ``model.generate`` returns them."""
    t0 = time.perf_counter()
    for i in batch.active:
        batch.rows[i].drafter.start(batch.rows[i].host_context)
    if batch.active:
        batch_prefill(batch)
        batch.stats.prefill_seconds = time.perf_counter() - t0
    trim_heap = heap_trimmer(batch.device)
    while batch.active:
        started, forward_before = time.perf_counter(), batch.stats.forward_seconds
        lead = batch.rows[batch.active[0]].policy
        cached = max(batch.rows[i].cached for i in batch.active)
        batch_step(batch)
        if trim_heap is not None:
            trim_heap()
        lead.observe_timing(batch.stats.inputs_per_pass[-1], cached, batch.stats.forward_seconds - forward_before,
                            time.perf_counter() - started)
    batch.stats.seconds = time.perf_counter() - t0
    return assemble(batch, pad_token_id)


def assemble(batch: Batch, pad_token_id: int | None) -> GenerateOutput:
    rows = batch.rows
    longest = max(g.length for g in rows)
    if pad_token_id is None and any(g.length < longest for g in rows):
        raise ValueError("rows ended at different lengths and there is no pad_token_id to fill the shorter ones; "
                         "set pad_token_id")
    fill = 0 if pad_token_id is None else int(pad_token_id)
    sequences = torch.full((len(rows), longest), fill, dtype=torch.long, device=batch.device)
    for r, g in enumerate(rows):
        sequences[r, : g.length] = g.buffer[0, : g.length]
        g.finish_stats()
    stats = batch.stats
    stats.new_tokens = sum(g.stats.new_tokens for g in rows)
    stats.accepted_lengths = [a for g in rows for a in g.stats.accepted_lengths]
    stats.choices = rows[0].policy.choice_counts()
    scores = None
    if rows[0].request.output_scores:
        steps = longest - rows[0].prompt_len
        vocab = next((g.scores[0].shape[-1] for g in rows if g.scores), 0)
        finished = torch.full((1, vocab), float("-inf"), device=batch.device)
        if vocab:
            finished[0, fill] = 0.0
        scores = tuple(
            torch.cat([(g.scores[t] if t < len(g.scores) else finished.to(g.scores[0].dtype if g.scores else torch.float32))
                       for g in rows])
            for t in range(steps)
        )
    out = GenerateOutput(sequences, stats, scores)
    out.row_stats = [g.stats for g in rows]
    return out
