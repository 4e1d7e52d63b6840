"""The converted copy of the embedded SmolLM2 GGUF file is the same model as a direct read: the
same weights bit for bit, config, generation config, name and tokenizer (Gemma 3 was checked the
same way by hand: a direct read takes ~90 s on the 2-core machine, too long to repeat per run)."""

from __future__ import annotations

import torch

import probe_mtp
from probe_mtp.loading import CONVERTED_DONE, converted_dir, smollm2_gguf_path
from probe_mtp.memory import tokenizer_identity

from conftest import chat_ids


def test_the_converted_copy_is_the_gguf_model(smollm2, specbench):
    model, tok = smollm2  # read through the copy (written by this load when there was none)
    assert (converted_dir(smollm2_gguf_path()) / CONVERTED_DONE).is_file()
    direct, direct_tok = probe_mtp.load_model(convert_cache=False, device=model.device)
    ours, theirs = model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # the same config, but the copy names its architecture (other engines, vLLM among them, read it)
    copied = model.config.to_dict()
    assert copied.pop("architectures") == ["LlamaForCausalLM"]
    read = direct.config.to_dict()
    read.pop("architectures", None)
    assert copied == read
    assert model.generation_config.to_dict() == direct.generation_config.to_dict()
    assert tokenizer_identity(tok) == tokenizer_identity(direct_tok)
    assert all(torch.equal(chat_ids(tok, p.turns[0]), chat_ids(direct_tok, p.turns[0])) for p in specbench[::8])


def test_a_bf16_load_reads_the_copy_onto_the_device_rounded(smollm2):
    """``dtype=torch.bfloat16`` on the session's device (``PROBE_MTP_TEST_DEVICE``): every weight
    in bf16 on that device, equal to the float32 weight cast."""
    model, _ = smollm2
    half, _ = probe_mtp.load_model(dtype=torch.bfloat16, device=model.device)
    ours, theirs = model.state_dict(), half.state_dict()
    assert half.device == model.device and {w.dtype for w in theirs.values()} == {torch.bfloat16}
    assert ours.keys() == theirs.keys() and all(torch.equal(theirs[k], ours[k].to(torch.bfloat16)) for k in ours)
