"""The plugin's model classes (vLLM imports this module when a plugin architecture is served; see
:mod:`probe_mtp.vllm.plugin`): each is vLLM's own class with the probe's placeholder handling in
``forward``, nothing else changed."""

from __future__ import annotations

import torch
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM

from .plugin import TOP_K, MaskOutput, MaskSlots
from .proposer import CONFIG_KEY


def _with_masks(base: type) -> type:
    """``base`` (a vLLM causal-LM class) with :class:`MaskSlots` placeholders (see the module)."""

    class WithProbeMasks(base):
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            config = vllm_config.model_config.hf_config
            text = getattr(config, "text_config", config)
            options = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY) or {}
            num_masks = int(options.get("num_masks", 2))
            vocab = int(text.vocab_size)
            placeholders = options.get("placeholder_ids") or tuple(range(vocab - num_masks, vocab))
            if any(not 0 <= int(t) < vocab for t in placeholders) or len(placeholders) != num_masks:
                raise ValueError(f"placeholder_ids must be {num_masks} ids below the vocabulary size {vocab}, "
                                 f"got {placeholders}")
            self.probe_masks = MaskSlots(tuple(placeholders), int(text.hidden_size))

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
            rows = where = None
            if inputs_embeds is None and input_ids is not None:
                rows, vectors, where = self.probe_masks.take(input_ids, positions)
                if rows.numel():
                    inputs_embeds = self.embed_input_ids(input_ids)
                    inputs_embeds[rows] = torch.stack(vectors).to(inputs_embeds.dtype)
                    input_ids = None
            hidden = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
            if rows is not None and rows.numel() and isinstance(hidden, torch.Tensor):
                logits = self.compute_logits(hidden[rows]).float()
                probs, tokens = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
                self.probe_masks.outputs = [MaskOutput(p, s, t, q) for (p, s), t, q
                                            in zip(where, tokens.tolist(), probs.tolist())]
                self.probe_masks.passes_with_masks += 1
            elif rows is not None:
                self.probe_masks.outputs = []
            return hidden

    WithProbeMasks.__name__ = WithProbeMasks.__qualname__ = f"ProbeMtp{base.__name__}"
    WithProbeMasks.__module__ = __name__
    return WithProbeMasks


ProbeMtpLlamaForCausalLM = _with_masks(LlamaForCausalLM)
ProbeMtpGemma3ForCausalLM = _with_masks(Gemma3ForCausalLM)
