"""Cosine alignment of the masks' hidden states with those of the true future tokens, for one prompt.

The paper's Lemma 3.1 ("Why it works" in the design notes): if the hidden state at a mask is close in
cosine similarity to the hidden state the true future token would have at that position, the true
token is in the mask's top-K.  This module measures both sides on a greedy continuation.

Positions count from 0 over ``prompt + continuation = x_0 .. x_{T-1}``; the prompt is ``x_0 .. x_{P-1}``.

- **Owner.** Every position ``q`` from ``P - 1`` (the last prompt token, whose masks the prefill
  appends) to ``T - 2`` owns ``k`` masks, as in the ESP layout where every tree node owns k masks.
  The analysis is teacher-forced: every greedy step is probed, not only the owners a decoding run
  happens to use (a superset of them).
- **Mask j of owner q** sits at position ``q + j`` (position id ``q + j``), sees ``x_0 .. x_q`` and
  the owner's masks ``1 .. j``, and its logits propose ``x_{q+j+1}``: the *target*.
- **The true token at the mask's position** is ``x_{q+j}``, the token the greedy continuation put
  at position ``q + j``.  Its hidden state is the one a plain causal pass over the greedy sequence
  gives there; its logits predict exactly the target (the sequence is greedy).  So the mask stands in
  for ``x_{q+1} .. x_{q+j}`` and is compared with the hidden state it would ideally reproduce.
- **cosine[l]** is the cosine similarity of the two hidden states after layer ``l``: index 0 is the
  input embedding (the mask vector against the true token's embedding), index ``l`` the output of
  decoder block ``l``, the last index after the final norm (transformers' ``hidden_states``).
- **control[l]** is the mean cosine of the mask's hidden state with the true hidden states at all
  *other* positions ``P-1 .. T-2`` of the continuation: how similar it is to unrelated tokens' states
  (hidden states share directions, so cosines are far from 0 even between unrelated tokens).
- **rank** counts the vocabulary tokens whose mask logit is strictly larger than the target's
  (0: the target is the mask's top-1 proposal).
- **accepted** means greedy verification accepts the mask's top-1 proposal when the owner's masks
  1..k propose the chain of their top-1 tokens (depth j from mask j): the top-1 of masks 1..j all
  equal their targets.  For mask 1 that is ``rank == 0``; for deeper masks it also needs every
  shallower mask right.  ``top1`` (``rank == 0``) is the mask's own hit, whatever its predecessors did.
- **Mask vectors** of owner ``q`` are the ones the decoder appends in a step whose root is ``x_q``:
  the initial vectors (``ProbeConfig.mask_init``) updated by the EMA with every generated token
  ``x_P .. x_q``; for ``q = P - 1`` (the prefill) the initial vectors.

Everything comes from one pass per prompt and setting: the prompt's first ``P - 1`` tokens fill a KV
cache, then one pass of the ESP layout of the chain ``x_{P-1} .. x_{T-2}`` with k masks per node and
``output_hidden_states=True`` yields every chain node's hidden states (identical to a causal pass up
to float rounding, ~1e-5 in fp32) and every mask's, at every layer at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import ProbeConfig
from ..architectures import attention_format
from ..kv import attention_inputs, new_cache
from ..masks import EmbeddingStats, config_mask_vectors, embedding_stats
from ..tree import chain, esp_layout


@dataclass(frozen=True)
class PromptAlignment:
    """The alignment of every mask of one greedy continuation, as dense arrays.

    ``n`` owners (positions ``prompt_len - 1 .. prompt_len + n - 2``), ``k`` masks, ``L + 1`` hidden
    states.  Entries whose target lies past the continuation are invalid (``valid`` False; cosine
    NaN, rank -1).
    """

    prompt_len: int
    owner_positions: np.ndarray  # [n] absolute position q of each owner
    valid: np.ndarray  # [n, k] bool: the target x_{q+j+1} exists
    cosine: np.ndarray  # [n, k, L+1] float32
    control: np.ndarray  # [n, k, L+1] float32: mean cosine with the other positions' true hidden states
    rank: np.ndarray  # [n, k] int64
    target: np.ndarray  # [n, k] token x_{q+j+1} (-1 where invalid)
    proposal: np.ndarray  # [n, k] the mask's top-1 token
    greedy_mismatches: int  # chain nodes whose argmax is not the next continuation token (0 for a greedy one in fp32)

    @property
    def num_masks(self) -> int:
        return int(self.valid.shape[1])

    @property
    def num_layers(self) -> int:
        """Hidden states per input: the embedding plus one per decoder block."""
        return int(self.cosine.shape[2])

    @property
    def top1(self) -> np.ndarray:
        return self.valid & (self.rank == 0)

    @property
    def accepted(self) -> np.ndarray:
        """Greedy verification of the owner's top-1 chain accepts depth j (see the module notes)."""
        return np.cumprod(self.top1, axis=1).astype(bool)


def owner_mask_vectors(
    embed: torch.nn.Module,
    prompt_ids: torch.Tensor,
    continuation_ids: torch.Tensor,
    num_owners: int,
    config: ProbeConfig,
    num_masks: int,
    stats: EmbeddingStats | None = None,
) -> torch.Tensor:
    """``[num_owners, k, H]``: owner i's (position ``P - 1 + i``) mask vectors, i.e. the initial
    vectors after the EMA update with the first i generated tokens.  ``stats`` (the vocabulary
    embedding statistics) is computed when ``mask_init="sample"`` needs it and none is given."""
    if config.mask_init == "sample" and stats is None:
        stats = embedding_stats(embed, embed.num_embeddings)
    masks = config_mask_vectors(config, embed, prompt_ids, num_masks, stats)
    out = [masks.vectors]
    with torch.no_grad():
        for i in range(1, num_owners):
            masks.update(embed(continuation_ids[i - 1 : i]))
            out.append(masks.vectors)
    return torch.stack(out)


def _check_ids(name: str, ids: torch.Tensor, min_len: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1D (or [1, L]) token ids, got shape {tuple(ids.shape)}")
    if ids.shape[0] < min_len:
        raise ValueError(f"{name} needs at least {min_len} token(s), got {ids.shape[0]}")
    return ids.long()


@torch.no_grad()
def align_masks(
    model,
    prompt_ids: torch.Tensor,
    continuation_ids: torch.Tensor,
    config: ProbeConfig | None = None,
    *,
    num_masks: int = 3,
    stats: EmbeddingStats | None = None,
) -> PromptAlignment:
    """Measure every mask of a greedy continuation (module notes give the definitions).

    ``prompt_ids``: the prompt's token ids (1D or ``[1, P]``, no padding).  ``continuation_ids``:
    the model's greedy continuation of it (at least 2 tokens).  ``config`` supplies the mask
    settings (``mask_init``, ``mask_update``, ``mask_token``, ``mask_seed``); its ``num_masks`` is
    ignored in favour of ``num_masks`` here, the masks per owner measured.  ``stats``: the
    vocabulary embedding statistics, needed (and computed if missing) for ``mask_init="sample"``.
    """
    config = config or ProbeConfig(drafter="esp")
    if not isinstance(num_masks, int) or isinstance(num_masks, bool) or num_masks < 1:
        raise ValueError(f"num_masks must be an integer >= 1, got {num_masks!r}")
    device = model.device
    prompt = _check_ids("prompt_ids", prompt_ids, 1).to(device)
    cont = _check_ids("continuation_ids", continuation_ids, 2).to(device)
    embed = model.get_input_embeddings()
    k = num_masks
    p, g = prompt.shape[0], cont.shape[0]
    n = g  # owners x_{P-1} .. x_{P+G-2}: the last generated token has no target after it
    chain_tokens = torch.cat([prompt[-1:], cont[: n - 1]])
    tree = chain(int(chain_tokens[0]), chain_tokens[1:].tolist())
    layout = esp_layout(tree, k)

    fmt = attention_format(model)
    cache = new_cache(model)
    if p > 1:
        model(input_ids=prompt[None, :-1], cache=cache, use_cache=True, logits_to_keep=1)

    vectors = owner_mask_vectors(embed, prompt, cont, n, config, k, stats)  # [n, k, H]
    node_embeds = embed(chain_tokens)
    embeds = torch.cat([node_embeds, vectors.reshape(n * k, -1).to(node_embeds.dtype)])
    positions = torch.tensor(layout.position_offsets, device=device) + (p - 1)
    attn = attention_inputs(cache, layout.visible, positions, fmt)

    # mask j of owner i is valid when its target x_{P+i+j} exists: i + j <= n - 1
    owner_idx = np.repeat(np.arange(n), k)
    j_idx = np.tile(np.arange(1, k + 1), n)
    valid = (owner_idx + j_idx <= n - 1).reshape(n, k)
    mask_rows = n + np.arange(n * k)  # the layout puts owner i's masks at n + i*k + (j-1)
    # logits: every chain node (for the greedy check) and the valid masks
    keep_rows = np.concatenate([np.arange(n), mask_rows[valid.reshape(-1)]])
    out = model(
        inputs_embeds=embeds[None],
        attention_mask=attn,
        position_ids=positions[None],
        cache=cache,
        use_cache=True,
        logits_to_keep=torch.from_numpy(keep_rows).to(device),
        output_hidden_states=True,
    )
    logits = out.logits[0].float()
    node_logits, mask_logits = logits[:n], logits[n:]
    true_next = cont[:n]  # chain node i (position P-1+i) predicts x_{P+i}
    mismatches = int((node_logits.argmax(-1) != true_next).sum())

    hidden = torch.stack(out.hidden_states)[:, 0].double()  # [L+1, N, H]
    flat_valid = valid.reshape(-1)
    rows_mask = torch.from_numpy(mask_rows[flat_valid]).to(device)
    rows_true = torch.from_numpy((owner_idx + j_idx)[flat_valid]).to(device)  # chain node at position q+j
    cos = torch.nn.functional.cosine_similarity(hidden[:, rows_mask], hidden[:, rows_true], dim=-1)  # [L+1, M]
    unit = torch.nn.functional.normalize(hidden, dim=-1)
    sims = unit[:, rows_mask] @ unit[:, :n].transpose(1, 2)  # [L+1, M, n]: each mask against every chain node
    own = sims.gather(2, rows_true.view(1, -1, 1).expand(sims.shape[0], -1, 1))[..., 0]
    control = (sims.sum(-1) - own) / (n - 1)

    targets = cont[torch.from_numpy((owner_idx + j_idx)[flat_valid]).to(device)]  # x_{P+i+j}
    target_logit = mask_logits.gather(1, targets[:, None])
    ranks = (mask_logits > target_logit).sum(1)
    proposals = mask_logits.argmax(-1)

    num_hidden = hidden.shape[0]
    cosine = np.full((n * k, num_hidden), np.nan, dtype=np.float32)
    cosine[flat_valid] = cos.T.float().cpu().numpy()
    control_all = np.full((n * k, num_hidden), np.nan, dtype=np.float32)
    control_all[flat_valid] = control.T.float().cpu().numpy()
    rank = np.full(n * k, -1, dtype=np.int64)
    rank[flat_valid] = ranks.cpu().numpy()
    target = np.full(n * k, -1, dtype=np.int64)
    target[flat_valid] = targets.cpu().numpy()
    proposal = np.full(n * k, -1, dtype=np.int64)
    proposal[flat_valid] = proposals.cpu().numpy()
    return PromptAlignment(
        prompt_len=p,
        owner_positions=np.arange(p - 1, p - 1 + n),
        valid=valid,
        cosine=cosine.reshape(n, k, num_hidden),
        control=control_all.reshape(n, k, num_hidden),
        rank=rank.reshape(n, k),
        target=target.reshape(n, k),
        proposal=proposal.reshape(n, k),
        greedy_mismatches=mismatches,
    )
