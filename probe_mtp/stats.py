"""What a generation returns besides its tokens: counts and timings (:class:`DecodeStats`) and the
result object of ``return_dict_in_generate=True`` (:class:`GenerateOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeStats:
    """Counts of one generation.

    - ``forward_passes``: every pass of the model, the prefill included;
    - ``new_tokens``: generated tokens (returned, after truncation at a stop);
    - ``accepted_lengths``: tokens committed by each decoding step after the prefill (accepted
      draft tokens + the bonus token, after truncation);
    - ``mean_accepted_length`` (tau): ``sum(accepted_lengths) / len(accepted_lengths)``.  The
      prefill pass and the first token it yields are *not* counted in tau, for every method alike
      (they are the same for all methods); ``forward_passes`` counts the prefill.
    """

    forward_passes: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    forward_seconds: float = 0.0
    inputs_per_pass: list[int] = field(default_factory=list)
    method: str = "esp"
    budget: int | str = 0
    num_masks: int = 0
    choices: dict = field(default_factory=dict)
    unverified_tokens: int = 0  # committed by acceptance="confadapt" without verification
    masks: str = ""  # which mask vectors: "bundled:<name>", a tuned file's name, or the untuned mask_init
    memory: str = ""  # "warm" (the decoder's drafting memory, shared across requests) or "cold"

    @property
    def mean_accepted_length(self) -> float:
        if not self.accepted_lengths:
            return 1.0
        return float(sum(self.accepted_lengths)) / len(self.accepted_lengths)

    @property
    def overhead_fraction(self) -> float:
        """Share of the decoding steps' time spent outside the model's forward pass (drafting,
        masks, verification, cache rollback, stopping checks); the prefill is left out."""
        steps = self.seconds - self.prefill_seconds
        if steps <= 0 or not self.accepted_lengths:
            return float("nan")
        return max(0.0, 1.0 - self.forward_seconds / steps)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "budget": self.budget,
            "num_masks": self.num_masks,
            "forward_passes": self.forward_passes,
            "new_tokens": self.new_tokens,
            "accepted_lengths": list(self.accepted_lengths),
            "mean_accepted_length": self.mean_accepted_length,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "forward_seconds": self.forward_seconds,
            "inputs_per_pass": list(self.inputs_per_pass),
            "choices": dict(self.choices),
            "unverified_tokens": self.unverified_tokens,
            "masks": self.masks,
            "memory": self.memory,
        }


@dataclass
class GenerateOutput:
    """Returned with ``return_dict_in_generate=True``: ``sequences`` as ``model.generate`` returns
    them, ``stats`` (:class:`DecodeStats`), and ``scores`` (a tuple of ``[1, V]`` processed scores,
    one per generated token) when ``output_scores=True``."""

    sequences: torch.Tensor
    stats: DecodeStats
    scores: tuple[torch.Tensor, ...] | None = None
