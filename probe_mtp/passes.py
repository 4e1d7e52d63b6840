"""The forward pass of a step: its inputs, the model call, and where the logits come from.

- :func:`assemble_inputs`: embeddings ``[root | nodes | masks]``, the tree attention mask (or the
  per-layer-type mapping) and depth-based position ids;
- :func:`forward_pass` / :func:`backbone_pass`: one call of the model (or of its backbone only) on
  top of the KV cache;
- :class:`OutputLayer`: the pass's logits.  With the split head (:mod:`probe_mtp.head`) the output
  layer runs only on the rows that are read: every node, and the masks of the one node whose masks
  seed the next tree, once verification has found it (:meth:`PassLogits.masks_of`).

Each function takes and returns plain tensors / arrays so it can be tested on toy inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .head import SplitHead
from .kv import AttentionFormat, attention_inputs
from .masks import MaskVectors
from .tree import TokenTree, TreeLayout
from .vocab import RowTops

# mask inputs whose logits are computed in the same output-layer call as the nodes' (the output
# layer costs a read of its whole weight per call, a few rows more cost little)
EAGER_MASK_ROWS = 8


@dataclass
class PassInputs:
    inputs_embeds: torch.Tensor  # [1, N, H]
    attention_mask: torch.Tensor | dict | None  # [1, 1, N, P+N], {"full_attention", "sliding_attention"}, or None: causal
    position_ids: torch.Tensor  # [1, N]


def assemble_inputs(
    embed: torch.nn.Module,
    tree: TokenTree,
    layout: TreeLayout,
    masks: MaskVectors | None,
    root_position: int,
    cache,
    fmt: AttentionFormat,
    past_visible: torch.Tensor | None = None,
) -> PassInputs:
    """Embeddings ``[root | nodes | masks]``, the tree attention mask and depth-based position ids."""
    device = fmt.device
    # padding inputs (pad_layout) repeat the root token
    node_ids = torch.tensor(np.concatenate([tree.tokens, np.repeat(tree.tokens[:1], layout.num_pad)]), device=device)
    embeds = embed(node_ids)
    if layout.num_masks:
        if masks is None:
            raise ValueError("a layout with mask slots needs mask vectors")
        mask_rows = layout.mask_index[layout.tree_size : layout.num_inputs - layout.num_pad]
        slot = torch.from_numpy(mask_rows - 1).to(device)
        mask_embeds = masks.vectors.index_select(0, slot).to(embeds.dtype)
        embeds = torch.cat([embeds[: tree.size], mask_embeds, embeds[tree.size :]], dim=0)
    if layout.num_inputs == 1 and past_visible is None:
        # a bare step (a lone root, no masks): plain causal decoding, so the model builds its own
        # mask, as under model.generate (sdpa then needs none at all for one query)
        return PassInputs(embeds[None], None, torch.tensor([[int(root_position)]], device=device))
    positions = torch.tensor(layout.position_offsets, device=device) + int(root_position)
    attn = attention_inputs(cache, layout.visible, positions, fmt, past_visible)
    return PassInputs(embeds[None], attn, positions[None])


def forward_pass(model, cache, inputs: PassInputs, logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
    """One forward pass on top of ``cache`` (which grows by N entries); returns logits ``[M, V]``
    as float32 (M = N, or the number of positions kept)."""
    out = model(
        inputs_embeds=inputs.inputs_embeds,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        cache=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits[0].float()


def backbone_pass(split_head: SplitHead, cache, inputs: PassInputs) -> torch.Tensor:
    """One forward pass of the model's backbone only: final hidden states ``[N, H]`` (the output
    layer is applied later, to the rows whose logits are used; see :mod:`probe_mtp.head`)."""
    return split_head.hidden_states(
        inputs_embeds=inputs.inputs_embeds,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        cache=cache,
        use_cache=True,
    )


@dataclass
class PassLogits:
    """The logits of one verification pass: ``nodes`` ``[tree.size, V]``; the logits of any other
    inputs through ``rows_of(input indices)``; ``tops``, every node's most probable tokens when a
    drafter reads them (computed once, also for the greedy walk)."""

    nodes: torch.Tensor
    layout: TreeLayout
    rows_of: Callable[[np.ndarray], torch.Tensor]
    tops: RowTops | None = None

    def masks_of(self, owner: int) -> torch.Tensor | None:
        """``[k, V]`` logits of ``owner``'s masks, None when it carried none."""
        slots = self.layout.mask_slots(owner)
        return self.rows_of(slots) if slots.size else None


class OutputLayer:
    """Runs a verification pass and hands out its logits.  ``head`` (a usable :class:`SplitHead`,
    or None: the model's own forward computes every row), ``padding[m]``: the row count to run the
    output layer on when m rows are wanted (the cheapest the cost curve measured; None: m)."""

    def __init__(self, model, head: SplitHead | None, padding: np.ndarray | None = None):
        self.model = model
        self.head = head
        self.padding = padding

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        count = hidden.shape[0]
        padding = self.padding
        rows = int(padding[count]) if padding is not None and count < padding.shape[0] else None
        return self.head.logits(hidden, rows=rows)

    def run(self, cache, inputs: PassInputs, layout: TreeLayout, tree_size: int) -> PassLogits:
        if self.head is None:
            logits = forward_pass(self.model, cache, inputs)
            return PassLogits(logits[:tree_size], layout, lambda slots: logits[torch.from_numpy(slots).to(logits.device)])
        hidden = backbone_pass(self.head, cache, inputs)
        end = layout.num_inputs - layout.num_pad
        if end - tree_size <= EAGER_MASK_ROWS:
            # few mask inputs (masks on the root only, say): their rows ride along with the
            # nodes', since a second call would read the whole output layer again
            logits = self.logits(hidden[:end])
            return PassLogits(logits[:tree_size], layout, lambda slots: logits[torch.from_numpy(slots).to(logits.device)])
        return PassLogits(self.logits(hidden[:tree_size]), layout,
                          lambda slots: self.logits(hidden[torch.from_numpy(slots).to(hidden.device)]))
