"""Tree passes on tiny random-weight models (Llama, Gemma 3 with sliding windows) give exactly
``model.generate``'s tokens: fast checks of the mechanics; the losslessness proofs on real models
are in tests/models/test_lossless_*.py."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig
from transformers import Gemma3ForCausalLM, LlamaForCausalLM

from probe_mtp import ProbeDecoder

from oracle import OracleDrafter


def _tiny_llama(attn: str):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=16, max_position_embeddings=256,
                         attn_implementation=attn, bos_token_id=0, eos_token_id=15, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _tiny_gemma(attn: str):
    torch.manual_seed(0)
    config = Gemma3TextConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=16, intermediate_size=64, vocab_size=16, sliding_window=8,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              max_position_embeddings=256, attn_implementation=attn,
                              bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gemma], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_passes_match_generate_on_tiny_models(make, attn):
    """Random weights, so the masks propose noise: this checks the mechanics (mask layout, both
    attention formats, sliding windows crossed many times, cache rollback), not acceptance."""
    model = make(attn)
    model.generation_config.eos_token_id = None
    decoder = ProbeDecoder(model, drafter="esp", num_masks=2, budget=24, mask_update=0.1)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 15, (1, 5 + 7 * seed), generator=g)
        ref = model.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None)
        out = decoder.generate(ids, max_new_tokens=40)
        assert torch.equal(out, ref)
        # an oracle drafter: blocks of up to 10 tokens accepted, window crossed mid-block
        continuation = ref[0, ids.shape[1] :].tolist()
        for limit in (1, 3, 17, 40):
            res = decoder.generate(ids, max_new_tokens=limit, drafter=OracleDrafter(continuation, ids.shape[1]),
                                   return_dict_in_generate=True)
            assert torch.equal(res.sequences, ref[:, : ids.shape[1] + limit])
            if limit == 40:
                assert res.stats.mean_accepted_length > 5
        # EOS inside an accepted block: stop right after it
        eos = continuation[12]
        ref_eos = model.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=eos)
        res = decoder.generate(ids, max_new_tokens=40, eos_token_id=eos, drafter=OracleDrafter(continuation, ids.shape[1]))
        assert torch.equal(res, ref_eos)
        assert res[0, -1].item() == eos
