"""The probe inside vLLM: a model plugin that gives reserved placeholder draft positions the probe's
mask vectors as input embeddings and hands the proposer what the model predicts there.

vLLM loads it through its documented plugin entry point (``vllm.general_plugins``, declared in
pyproject.toml): :func:`register` adds, with ``ModelRegistry.register_model``, an architecture per
supported model class (``ProbeMtpLlamaForCausalLM``, ``ProbeMtpGemma3ForCausalLM``), each a subclass
of vLLM's own class (no modeling code copied).  Serve a model with it by naming the architecture:

    LLM(folder, hf_overrides={"architectures": ["ProbeMtpLlamaForCausalLM"]},
        speculative_config={"method": "custom_class", "model": "probe_mtp.vllm.Proposer", ...},
        additional_config={"probe_mtp": {"num_masks": 2}})

How it fits vLLM's chains.  The proposer drafts ``[d1 .. dj, P1 .. Pm]``: its chain, then the m
placeholder ids (:attr:`MaskSlots.placeholder_ids`).  Before the pass it tells the model, through
the model object vLLM hands every proposer (``load_model``), which positions of which rows carry
which mask vectors (the request's own: prompt mean with its update, plus the tuned offsets where
the model has bundled ones); the model's ``forward`` puts those vectors in place of the placeholders'
embeddings and, after the pass, keeps the top tokens predicted at the mask positions.  vLLM verifies
``P1`` against the model's token after ``dj``: it is rejected (the model's own token is committed
there), so nothing a mask position computes is ever committed; when all of ``d1..dj`` were accepted
the masks saw exactly the committed context, and mask i's top token drafts the token i after the
committed one (embedding-space probing, ESP), proposed at the next step.

What it cannot do (vLLM 0.32's interfaces; see docs/vllm.md): trees (the CPU attention verifies
chains only), the model's top-k at verified positions (the sampler's logits never reach a proposer;
the plugin could keep them only by computing the output layer a second time), and an exact
guarantee in one corner: a placeholder is a real vocabulary id, so where the model's own next token
after ``dj`` *is* the placeholder id, vLLM accepts it and commits the token after it from the mask's
logits.  The default placeholders are ids the model never produces in practice (checked and
counted by the proposer: ``stats["placeholder_hits"]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# plugin architecture -> the vLLM class it extends (the plugin classes are in probe_mtp.vllm.models)
ARCHITECTURES = {
    "ProbeMtpLlamaForCausalLM": "LlamaForCausalLM",
    "ProbeMtpGemma3ForCausalLM": "Gemma3ForCausalLM",
}
TOP_K = 4  # tokens kept per mask position


def register() -> None:
    """vLLM's general-plugin entry point (run in every vLLM process; idempotent)."""
    from vllm import ModelRegistry

    for name in ARCHITECTURES:
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"probe_mtp.vllm.models:{name}")


def architecture_for(hf_architecture: str) -> str:
    """The plugin architecture that serves ``hf_architecture`` (``LlamaForCausalLM`` ->
    ``ProbeMtpLlamaForCausalLM``); a ValueError naming the supported ones otherwise."""
    for name, base in ARCHITECTURES.items():
        if base == hf_architecture:
            return name
    raise ValueError(f"the probe-mtp vLLM plugin has no class for {hf_architecture!r}; supported: "
                     f"{sorted(ARCHITECTURES.values())}")


@dataclass
class MaskOutput:
    """What the model predicted at one mask position: its position, slot, top tokens and their
    probabilities."""

    position: int
    slot: int
    tokens: list[int]
    probs: list[float]


class MaskSlots:
    """The channel between the proposer and the model (one per model object, in the worker process):
    the placeholder ids, the mask vectors armed for the next pass, what the last pass predicted."""

    def __init__(self, placeholder_ids: tuple[int, ...], hidden_size: int):
        if len(set(placeholder_ids)) != len(placeholder_ids):
            raise ValueError(f"placeholder ids must differ, got {placeholder_ids}")
        self.placeholder_ids = tuple(int(t) for t in placeholder_ids)
        self.hidden_size = int(hidden_size)
        self._armed: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.outputs: list[MaskOutput] = []
        self.passes_with_masks = 0

    @property
    def num_masks(self) -> int:
        return len(self.placeholder_ids)

    def arm(self, position: int, slot: int, vector: torch.Tensor) -> None:
        """The next pass's placeholder ``slot`` at ``position`` gets ``vector`` (in row order when
        several rows have one at the same position)."""
        if not 0 <= slot < self.num_masks:
            raise ValueError(f"mask slot {slot} out of range (the model has {self.num_masks})")
        if vector.shape != (self.hidden_size,):
            raise ValueError(f"a mask vector must be [{self.hidden_size}], got {tuple(vector.shape)}")
        self._armed.setdefault((int(position), int(slot)), []).append(vector)

    def take(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list, list]:
        """The rows of this pass that are armed placeholders, their vectors and (position, slot);
        what was armed is used once (a pass that does not carry it drops it)."""
        armed, self._armed = self._armed, {}
        if not armed:
            return input_ids.new_zeros(0, dtype=torch.long), [], []
        ids = torch.tensor(self.placeholder_ids, device=input_ids.device, dtype=input_ids.dtype)
        candidates = torch.isin(input_ids, ids).nonzero().flatten().tolist()
        rows, vectors, where = [], [], []
        slot_of = {t: j for j, t in enumerate(self.placeholder_ids)}
        id_list, pos_list = input_ids.tolist(), positions.tolist()
        for row in candidates:
            key = (int(pos_list[row]), slot_of[int(id_list[row])])
            queue = armed.get(key)
            if queue:
                rows.append(row)
                vectors.append(queue.pop(0))
                where.append(key)
        return torch.tensor(rows, dtype=torch.long, device=input_ids.device), vectors, where
