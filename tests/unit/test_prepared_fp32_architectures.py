"""The tiny-architecture matrix of test_architectures.py prepared for float32
(``probe_mtp.optimize(model, torch.float32)``): every case optimize prepares decodes bit-identical to
``model.generate`` on the same prepared model (no near-tie allowance), with the default
configuration and with the oracle drafter's long blocks across sliding windows; the rest is refused
with the reason bf16 is refused for.  Lean: no ESP pass (the bf16 matrix has it), one thread."""

from __future__ import annotations

import logging

import pytest
import torch

import probe_mtp

from test_architectures import ARCHS, MODES, NEW_TOKENS, NOT_PREPARED, ORACLE_BUDGET, PROMPTS, OracleDrafter


@pytest.fixture(autouse=True, scope="module")
def _one_thread_and_quiet():
    """One thread (tiny models: a second thread only adds synchronisation) and transformers' errors
    only (random tiny configs warn about defaulted settings)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_prepared_float32_decodes_token_identical_to_generate(arch):
    model = arch.build()
    if arch.name in NOT_PREPARED:
        with pytest.raises(probe_mtp.OptimizeError, match=NOT_PREPARED[arch.name]):
            probe_mtp.optimize(model, torch.float32)
        return
    probe_mtp.optimize(model, torch.float32)
    assert probe_mtp.is_optimized(model) and model.dtype == torch.float32
    accepted = []
    for prompt_name, ids in PROMPTS.items():
        ref = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
        p = ids.shape[1]
        out = probe_mtp.generate(model, ids, max_new_tokens=NEW_TOKENS, **MODES["default"])
        assert torch.equal(out, ref), f"{arch.name}/{prompt_name}/default: differs from model.generate"
        res = probe_mtp.generate(model, ids, max_new_tokens=NEW_TOKENS, drafter=OracleDrafter(ref[0, p:].tolist(), p),
                                 budget=ORACLE_BUDGET, return_dict_in_generate=True)
        assert torch.equal(res.sequences, ref), f"{arch.name}/{prompt_name}/oracle: differs from model.generate"
        accepted.append(res.stats.mean_accepted_length)
    assert min(accepted) > 5, f"{arch.name}: the oracle's blocks were not accepted (tau {accepted})"
