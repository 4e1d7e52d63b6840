"""Verification: the model's own choice at every tree node, and the walk that accepts drafts.

- :func:`path_token_matrix` / :func:`process_node_logits`: logits processors (repetition penalty,
  no-repeat n-grams, min-new-tokens, temperature, top-p, ...) see each node's own path, batched by
  depth so that every row of a call has the same length.
- :func:`accept_greedy`: the greedy walk (argmax at each node, move to the child carrying it);
  :func:`accept_greedy_lazily` takes the argmax only at the nodes the walk reaches.
- :func:`accept_sample_and_match`: lossless sampling.  At each accepted node draw ``x ~ p`` from the
  processed target distribution; move to the child carrying x if there is one, else x is the bonus.
  Every committed token is drawn from exactly the distribution plain sampling would use.
- :func:`accept_recursive_rejection`: lossless multi-draft rejection (SpecInfer; EAGLE's
  ``evaluate_posterior``) for children drawn i.i.d. from a draft distribution q: for each draw c in
  turn, accept with probability ``min(1, p(c) / q(c))``; on rejection ``p <- norm(max(p - q, 0))``;
  if every draw is rejected the bonus is drawn from the residual p.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .tree import TokenTree
from .vocab import vocab_argmax


def path_token_matrix(tree: TokenTree) -> np.ndarray:
    """``M[i, :depth(i)]`` are the draft tokens on the path root -> i (root excluded); the rest -1."""
    n, depth = tree.size, tree.max_depth
    out = np.full((n, max(depth, 1)), -1, dtype=np.int64)
    for d in range(1, depth + 1):
        level = np.flatnonzero(tree.depths == d)
        out[level, : d - 1] = out[tree.parents[level], : d - 1]
        out[level, d - 1] = tree.tokens[level]
    return out


def process_node_logits(processors, context: torch.Tensor, tree: TokenTree, node_logits: torch.Tensor) -> torch.Tensor:
    """Apply ``processors`` (a ``LogitsProcessorList`` or None) to every node's logits with the
    node's own sequence ``context + path`` as ``input_ids``.  ``context`` is 1D: every committed
    token, the root last.  Returns float32 scores ``[n, V]``."""
    if not processors:
        return node_logits
    out = torch.empty_like(node_logits)
    paths = torch.from_numpy(path_token_matrix(tree)).to(context.device)
    for d in range(tree.max_depth + 1):
        level = torch.from_numpy(np.flatnonzero(tree.depths == d)).to(node_logits.device)
        rows = level.numel()
        ids = context.view(1, -1).expand(rows, -1)
        if d:
            ids = torch.cat([ids, paths[level, :d]], dim=1)
        out[level] = processors(ids, node_logits[level].clone())
    return out


def process_node_row(processors, context: torch.Tensor, tree: TokenTree, node_logits: torch.Tensor, node: int) -> torch.Tensor:
    """One row of :func:`process_node_logits`: node ``node``'s ``[1, V]`` scores (a view of
    ``node_logits`` when there are no processors).  Processors work row by row, so this equals
    that function's row ``node``; asking only the rows a walk reaches keeps the processed copy
    at about tau rows instead of the whole tree's."""
    row = node_logits[node : node + 1]
    if not processors:
        return row
    path = torch.from_numpy(tree.path_tokens(node)[1:]).to(context.device)
    ids = torch.cat([context, path]).view(1, -1)
    return processors(ids, row.clone())


class NodeRows(Sequence):
    """The ``[1, V]`` rows ``make(node)`` of a path's ``nodes``, made when read and not kept: with
    logits processors every row is a fresh copy, and a 40-token accepted path would otherwise hold
    40 vocabulary-sized rows at once (40 MB on Gemma 3) for the stopping criteria to read."""

    def __init__(self, make, nodes: list[int]):
        self.make = make
        self.nodes = list(nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.make(n) for n in self.nodes[i]]
        return self.make(self.nodes[i])


def node_targets(node_logits: torch.Tensor) -> np.ndarray:
    """Greedy: the model's next token after each node (argmax of its processed logits), on the host."""
    return vocab_argmax(node_logits).cpu().numpy()


def accept_greedy(tree: TokenTree, targets: np.ndarray) -> np.ndarray:
    """Walk from the root: move to the child carrying the model's token while one exists.

    Returns the accepted node indices, root first; the bonus token is ``targets[path[-1]]``.
    """
    if tree.size == 1:
        return np.zeros(1, dtype=np.int64)
    matches = np.zeros(tree.size, dtype=bool)
    matches[1:] = tree.tokens[1:] == targets[tree.parents[1:]]
    candidates = np.flatnonzero(matches)
    parents_of_matches = tree.parents[candidates]
    path = [0]
    while True:
        nxt = candidates[parents_of_matches == path[-1]]
        if nxt.size == 0:
            return np.array(path, dtype=np.int64)
        path.append(int(nxt[0]))


def accept_greedy_lazily(tree: TokenTree, target_of) -> tuple[np.ndarray, int]:
    """:func:`accept_greedy` asking ``target_of(node)`` for the model's token only at the nodes
    it reaches: the accepted path, about tau rows instead of the whole tree.  Returns the path
    (root first) and the bonus token.  Any rule that picks one token per reached node walks this
    way (sample-and-match draws it)."""
    path = [0]
    while True:
        target = int(target_of(path[-1]))
        kids = np.flatnonzero((tree.parents == path[-1]) & (tree.tokens == target))
        if kids.size == 0:
            return np.array(path, dtype=np.int64), target
        path.append(int(kids[0]))


def _child_by_token(tree: TokenTree, node: int) -> dict[int, int]:
    kids = tree.children(node)
    return {int(tree.tokens[c]): int(c) for c in kids}


def accept_sample_and_match(tree: TokenTree, node_probs: torch.Tensor, generator: torch.Generator | None):
    """Lossless sampling by sample-and-match.  ``node_probs``: ``[n, V]`` processed target
    probabilities.  Returns ``(accepted path, bonus token)``.  One draw per node the walk reaches,
    made when it gets there (a host read per draw: the CPU's way)."""
    return accept_greedy_lazily(tree, lambda node: torch.multinomial(node_probs[node], 1, generator=generator))


def default_generator(device: torch.device) -> torch.Generator | None:
    """The generator torch draws with on ``device`` when none is given (None: not known here)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return None
    index = device.index if device.index is not None else module.current_device()
    return generators[index]


def accept_sample_and_match_at_once(tree: TokenTree, node_probs: torch.Tensor, generator: torch.Generator | None):
    """:func:`accept_sample_and_match` with every draw made before the walk and read back in one
    transfer, drawing exactly what it draws: every node at depth d draws from the generator's state
    before depth d (the state the one-at-a-time walk has when it reaches depth d, whichever node it
    is at: a draw over one row always advances the state by as much), and afterwards the generator
    is left where that walk leaves it.  So the tokens, and every later draw, are the same as drawing
    when the walk arrives, on any device.  Returns None where the default generator of
    ``node_probs``' device cannot be had (call :func:`accept_sample_and_match` then)."""
    gen = generator if generator is not None else default_generator(node_probs.device)
    if gen is None:
        return None
    draws = torch.empty(tree.size, dtype=torch.long, device=node_probs.device)
    states = []
    for depth in range(tree.max_depth + 1):
        states.append(gen.get_state())
        for node in np.flatnonzero(tree.depths == depth).tolist():
            gen.set_state(states[depth])
            draws[node : node + 1] = torch.multinomial(node_probs[node], 1, generator=gen)
    states.append(gen.get_state())
    drawn = draws.cpu().numpy()
    path, bonus = accept_greedy_lazily(tree, drawn.__getitem__)
    gen.set_state(states[len(path)])  # as many draws made as the walk's nodes
    return path, bonus


def accept_recursive_rejection(
    tree: TokenTree,
    node_probs: torch.Tensor,
    draft_probs: dict[int, torch.Tensor],
    draws: dict[int, list[int]],
    generator: torch.Generator | None,
):
    """Lossless multi-draft rejection sampling.

    ``draft_probs[node]``: the distribution q (``[V]``) the node's children were drawn from;
    ``draws[node]``: the i.i.d. draws from q in the order they were made (repeats allowed; each
    draw's token is a child of the node).  Nodes absent from ``draft_probs`` have no children.
    Returns ``(accepted path, bonus token)``.
    """
    path = [0]
    while True:
        node = path[-1]
        p = node_probs[node].double()
        q = draft_probs.get(node)
        moved = False
        if q is not None:
            q = q.double()
            kids = _child_by_token(tree, node)
            for c in draws.get(node, ()):
                qc = float(q[c])
                ratio = 1.0 if qc <= 0.0 else min(1.0, float(p[c]) / qc)
                u = float(torch.rand((), generator=generator, dtype=torch.float64, device=p.device))
                if u < ratio:
                    path.append(kids[c])
                    moved = True
                    break
                residual = torch.clamp(p - q, min=0.0)
                total = float(residual.sum())
                if total <= 0.0:  # p <= q everywhere: p == q, every further draw would be accepted
                    residual = p
                    total = float(residual.sum())
                p = residual / total
        if not moved:
            x = int(torch.multinomial(p.float(), 1, generator=generator))
            return np.array(path, dtype=np.int64), x
