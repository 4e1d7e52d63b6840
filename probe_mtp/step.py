"""One decoding step as a pipeline of small functions.

    tree   = drafter.propose(root)                      # tree/ : build from the previous masks
    layout = esp_layout(tree, k)                        # cached per tree shape by the decoder
    inputs = assemble_inputs(...)                       # embeds, 4D mask (or dict), position ids
    logits = forward_pass(model, cache, inputs)         # one pass over BC inputs
    path   = accept_greedy(tree, node_targets(...))     # verify.py : walk the tree with the model's own tokens
    keep_accepted(cache, ...)                           # kv.py : prefix + accepted path
    drafter.observe(mask logits of path[-1])            # seed the next tree

Each function takes and returns plain tensors / arrays so it can be tested on toy inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kv import AttentionFormat, attention_inputs
from .masks import MaskVectors
from .tree import TokenTree, TreeLayout
from .vocab import top_probabilities, vocab_argmax


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


def backbone_pass(split_head, cache, inputs: PassInputs) -> torch.Tensor:
    """One forward pass of the model's backbone only: final hidden states ``[N, H]`` (the output
    layer is applied later, to the rows whose logits are used; see :mod:`probe_mtp.head`)."""
    return split_head.hidden_states(
        inputs_embeds=inputs.inputs_embeds,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        cache=cache,
        use_cache=True,
    )


def node_targets(node_logits: torch.Tensor) -> np.ndarray:
    """Greedy: the model's next token after each node (argmax of its processed logits)."""
    return vocab_argmax(node_logits).cpu().numpy()


def top_candidates(mask_logits: torch.Tensor, width: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per mask j, the ``width`` most probable tokens and their probabilities (descending)."""
    toks, ps = top_probabilities(mask_logits, width)
    return list(toks.cpu().numpy()), list(ps.double().cpu().numpy())
