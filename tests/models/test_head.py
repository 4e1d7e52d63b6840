"""The split output head (probe_mtp.head) on SmolLM2 reproduces the model's logits, also when run
on more rows than wanted."""

from __future__ import annotations

import torch

from probe_mtp.head import SplitHead


def test_split_head_reproduces_the_models_logits(smollm2):
    model, _ = smollm2
    head = SplitHead(model)
    assert head.usable
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
        got = head.logits(head.hidden_states(input_ids=ids))
    assert torch.equal(want, got)
    # run on more rows than wanted (zero-padded): the same logits for the rows wanted
    hidden = head.hidden_states(input_ids=ids)
    with torch.no_grad():
        padded = head.logits(hidden[:3], rows=16)
    assert padded.shape == (3, want.shape[1])
    torch.testing.assert_close(padded, want[:3], rtol=0, atol=1e-4)
    assert torch.equal(padded.argmax(-1), want[:3].argmax(-1))
