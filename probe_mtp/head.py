"""The output layer, applied only where its logits are used.

A verification pass needs the logits of every tree node, but of the mask inputs only those of the
deepest accepted node (known after verification).  With k masks per node, computing the output
layer for every input wastes k/(k+1) of it; for Gemma's 262k-token vocabulary the output layer is
most of a pass.  :class:`SplitHead` runs the model's backbone, then its output layer on chosen rows.

It is used only when it reproduces the model's own logits exactly: at construction it compares both
on a short input, and falls back (``usable = False``) for models whose logits need more than the
output embedding and an optional final soft-capping.
"""

from __future__ import annotations

import torch


class SplitHead:
    def __init__(self, model):
        self.model = model
        self.backbone = None
        self.head = None
        self.softcap = None
        self.usable = False
        try:
            backbone = model.get_decoder()
            head = model.get_output_embeddings()
        except (AttributeError, NotImplementedError):
            return
        if backbone is None or head is None or backbone is model:
            return
        self.backbone, self.head = backbone, head
        text_config = model.config.get_text_config()
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        self.usable = self._reproduces_model()

    def logits(self, hidden: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """``[M, H]`` final hidden states -> ``[M, V]`` float32 logits, as the model computes them.
        ``rows`` (at least M): run the layer on that many rows, zero-padded, and return the first
        M, because BLAS may take several times longer over M rows than over a few more (see
        :meth:`probe_mtp.cost.CostCurve.head_padding`); each row's logits do not depend on the
        others'."""
        count = hidden.shape[0]
        if rows is not None and rows > count:
            hidden = torch.cat([hidden, hidden.new_zeros(rows - count, hidden.shape[1])])
        out = self.head(hidden)
        if self.softcap is not None:
            # in place: the same operations as the model's, without two more [M, V] temporaries
            # (for Gemma's 262k vocabulary 1 MB per row, the largest transient of a wide pass)
            out = out.div_(self.softcap).tanh_().mul_(self.softcap)
        return out.float()[:count]

    def hidden_states(self, **inputs) -> torch.Tensor:
        """The backbone's final (normalised) hidden states ``[N, H]`` for a batch of one."""
        return self.backbone(**inputs).last_hidden_state[0]

    def batch_hidden_states(self, **inputs) -> torch.Tensor:
        """The backbone's final hidden states ``[B, N, H]`` for a batch."""
        return self.backbone(**inputs).last_hidden_state

    @torch.no_grad()
    def _reproduces_model(self) -> bool:
        vocab = self.model.get_input_embeddings().num_embeddings
        ids = torch.arange(3, device=self.model.device)[None] % vocab
        try:
            expected = self.model(input_ids=ids, use_cache=False).logits[0].float()
            got = self.logits(self.hidden_states(input_ids=ids, use_cache=False))
        except Exception:  # noqa: BLE001 - any failure means: use the model's own forward
            return False
        return expected.shape == got.shape and torch.equal(expected, got)
