"""The state of one generation: what a decoding step reads and writes.

A :class:`Generation` is built by the decoder for one request and never outlives it: the committed
tokens, the KV cache, the mask vectors, the drafter, the budget policy, the acceptance rule and the
statistics.  The step itself (:mod:`probe_mtp.step`) is a pipeline of functions over this state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .acceptance import AcceptanceRule
from .clock import DeviceClock
from .adaptive import BudgetPolicy
from .drafters import Drafter
from .kv import AttentionFormat
from .masks import MaskVectors
from .passes import OutputLayer
from .request import DecodeRequest
from .stats import DecodeStats, GenerateOutput
from .tree import TokenTree, TreeLayout


@dataclass
class Parts:
    """What a generation uses of its decoder: the model, its input embedding module, how attention
    masks are handed to it, the pass's output layer, and the decoder's cache of tree layouts."""

    model: object
    embed: torch.nn.Module
    fmt: AttentionFormat
    output: OutputLayer
    layouts: object  # LayoutCache: layout(tree, num_masks, pad_to, owners) -> TreeLayout


class Generation:
    """One request being decoded (see the module docstring).  ``buffer[0, :length]`` holds the
    row's left padding (``offset`` tokens), the prompt and every committed token; the KV cache holds
    all real tokens but the last (the next root)."""

    def __init__(self, parts: Parts, request: DecodeRequest, drafter: Drafter, policy: BudgetPolicy,
                 accept: AcceptanceRule, masks: MaskVectors | None, cache, stats: DecodeStats):
        self.parts = parts
        self.request = request
        self.drafter = drafter
        self.policy = policy
        self.accept = accept
        self.masks = masks
        self.cache = cache
        self.stats = stats
        self.device = parts.model.device
        self.clock = DeviceClock(self.device)
        self.pass_marks = None  # the last verify pass's clock marks, until the step reads them
        prompt = request.prompt.to(self.device)
        self.offset = request.pads
        self.prompt_len = self.offset + prompt.shape[1]  # in the buffer: padding and prompt
        # every committed token, in a buffer that stopping criteria and processors read as a view,
        # and its host copy (``tokens``), which the drafters read: kept up to date by commit, so a
        # step never copies the sequence back from the device
        size = max(request.max_length, self.prompt_len + 1)
        self.buffer = torch.empty((1, size), dtype=torch.long, device=self.device)
        if self.offset:
            self.buffer[:, : self.offset] = request.pad_prefix.to(self.device)
        self.buffer[:, self.offset : self.prompt_len] = prompt
        self.tokens = np.empty(size, dtype=np.int64)
        self.tokens[: self.prompt_len] = self.buffer[0, : self.prompt_len].cpu().numpy()  # once per request
        self.length = self.prompt_len
        self.scores: list[torch.Tensor] = []
        self.done = self.length >= request.max_length

    @property
    def sequence(self) -> torch.Tensor:
        """``[1, length]``: padding, prompt and every committed token, as transformers' logits
        processors and stopping criteria see the row (a view)."""
        return self.buffer[:, : self.length]

    @property
    def context(self) -> torch.Tensor:
        """1D: the prompt and every committed token, the next root last, without padding (what the
        model and the drafter see; a view)."""
        return self.buffer[0, self.offset : self.length]

    @property
    def host_context(self) -> np.ndarray:
        """:attr:`context` on the host (a view of :attr:`tokens`)."""
        return self.tokens[self.offset : self.length]

    @property
    def root(self) -> int:
        """The last committed token (the next tree's root), read on the host."""
        return int(self.tokens[self.length - 1])

    def write(self, tokens: np.ndarray) -> None:
        """Put ``tokens`` after the committed ones, on the host and in the device buffer (one
        transfer), without committing them: :attr:`length` is unchanged."""
        end = self.length + len(tokens)
        self.tokens[self.length : end] = tokens
        self.buffer[0, self.length : end] = torch.from_numpy(self.tokens[self.length : end]).to(self.device)

    @property
    def cached(self) -> int:
        """Tokens in the KV cache: every real one but the root (also the root's position id)."""
        return self.length - 1 - self.offset

    def layout(self, tree: TokenTree, num_masks: int, pad_to: int = 0, owners: np.ndarray | None = None) -> TreeLayout:
        return self.parts.layouts.layout(tree, num_masks, pad_to, owners)

    def embed_tokens(self, tokens) -> torch.Tensor:
        return self.parts.embed(torch.as_tensor(np.asarray(tokens), device=self.device))

    def finish_stats(self) -> None:
        self.stats.new_tokens = self.length - self.prompt_len
        self.stats.choices = self.policy.choice_counts()

    def result(self) -> GenerateOutput:
        self.finish_stats()
        scores = tuple(self.scores) if self.request.output_scores else None
        return GenerateOutput(self.sequence.clone(), self.stats, scores)
