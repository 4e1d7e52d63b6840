"""Token trees for tree-structured speculative decoding, model-free.

This package knows nothing about language models: it holds draft tokens with parent pointers,
builds trees from candidate distributions under a node budget, lays them out as the ESP input
block (``[root | nodes breadth-first | k masks per owner]``) with attention rules and position
offsets, counts block complexity and exports to networkx.  It is installed as ``probe_mtp.tree``.
"""

from .token_tree import TokenTree
from .build import best_first, chain, grow_best_first
from .budget import block_complexity, node_budget, min_block_complexity
from .layout import LayoutCache, TreeLayout, esp_layout, pad_layout, prefill_layout
from .select import best_order, choose_node_count, keep_nodes, path_monotone
from .attention import (
    additive_mask,
    full_attention_mask,
    sliding_attention_mask,
)

__all__ = [
    "TokenTree",
    "TreeLayout",
    "LayoutCache",
    "best_first",
    "chain",
    "grow_best_first",
    "block_complexity",
    "node_budget",
    "min_block_complexity",
    "esp_layout",
    "pad_layout",
    "prefill_layout",
    "best_order",
    "choose_node_count",
    "keep_nodes",
    "path_monotone",
    "additive_mask",
    "full_attention_mask",
    "sliding_attention_mask",
]
