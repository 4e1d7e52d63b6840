"""A test drafter that knows the answer."""

from __future__ import annotations

from probe_mtp.drafters import Drafter
from probe_mtp.tree import TokenTree


class OracleDrafter(Drafter):
    """Proposes the true continuation as one long chain (plus a decoy branch), so that whole
    blocks are accepted and stops land inside them."""

    name = "oracle"
    num_masks = 0

    def __init__(self, continuation: list[int], prompt_len: int, budget: int = 12):
        super().__init__(budget)
        self.continuation = continuation
        self.prompt_len = prompt_len

    def propose(self, root_token, context):
        done = len(context) - self.prompt_len  # generated tokens so far, root included
        ahead = self.continuation[done : done + self.max_nodes - 1]
        decoy = [(ahead[0] + 1) % 16] if ahead else []
        return TokenTree.from_paths(root_token, [ahead, decoy] if ahead else [])
