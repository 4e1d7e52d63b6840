"""The converted-copy cache of GGUF models: written once, read back bit for bit, a damaged copy
replaced with a warning, an unwritable cache costing a warning and never a failure.  A tiny random
Llama stands in for what transformers reads from the GGUF file (the real files: tests/models)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers

import probe_mtp.loading as loading


def _tiny():
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=32, vocab_size=32, max_position_embeddings=64, tie_word_embeddings=True,
                         attn_implementation="sdpa", bos_token_id=0, eos_token_id=1, pad_token_id=0)
    vocab = {f"t{i}": i for i in range(32)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return LlamaForCausalLM(config).eval(), PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t1")


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A stand-in GGUF file whose reads are counted; the cache in tmp_path."""
    monkeypatch.setenv("PROBE_MTP_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "models" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF stand-in")
    reads = []
    real = loading._from_pretrained

    def fake(source, extra, dtype, attn, device=None):
        if "gguf_file" in extra:
            assert device is None  # a GGUF file is dequantized on the host, then moved
            reads.append(dtype)
            model, tok = _tiny()
            model.config.name_or_path = source  # as transformers names a model read from a folder
            return model.to(dtype), tok
        return real(source, extra, dtype, attn, device=device)

    monkeypatch.setattr(loading, "_from_pretrained", fake)
    return path, reads


def test_the_first_load_writes_a_copy_that_later_loads_read(gguf):
    path, reads = gguf
    first, tok = loading.load_model(str(path))
    assert reads == [torch.float32] and (loading.converted_dir(path) / loading.CONVERTED_DONE).is_file()
    again, tok_again = loading.load_model(str(path))
    assert reads == [torch.float32]  # the GGUF file was not read again
    ref = _tiny()[0].state_dict()
    assert all(torch.equal(again.state_dict()[k], ref[k]) for k in ref)
    assert again.lm_head.weight.data_ptr() == again.get_input_embeddings().weight.data_ptr()  # still tied
    assert again.config.name_or_path == first.config.name_or_path == str(path.parent)
    assert tok_again("t3 t5 t7")["input_ids"] == tok("t3 t5 t7")["input_ids"] == [3, 5, 7]
    half, _ = loading.load_model(str(path), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half.lm_head.weight, ref["lm_head.weight"].bfloat16())


def test_a_changed_file_or_convert_cache_false_reads_the_gguf_file(gguf):
    path, reads = gguf
    loading.load_model(str(path))
    loading.load_model(str(path), convert_cache=False)
    assert len(reads) == 2
    before = loading.converted_dir(path)
    path.write_bytes(b"GGUF stand-in, another version")
    assert loading.converted_dir(path) != before  # a new key: size and mtime changed
    loading.load_model(str(path))
    assert len(reads) == 3


def test_a_damaged_copy_is_replaced_with_a_warning(gguf):
    path, reads = gguf
    loading.load_model(str(path))
    (loading.converted_dir(path) / "model.safetensors").write_bytes(b"truncated")
    with pytest.warns(UserWarning, match="could not be read"):
        model, _ = loading.load_model(str(path))
    assert len(reads) == 2 and torch.equal(model.lm_head.weight, _tiny()[0].lm_head.weight)
    loading.load_model(str(path))
    assert len(reads) == 2  # rewritten


def test_an_unwritable_cache_costs_a_warning_not_the_load(gguf, tmp_path, monkeypatch):
    path, reads = gguf
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("PROBE_MTP_CACHE_DIR", str(blocker))
    with pytest.warns(UserWarning, match="could not keep a converted copy"):
        model, _ = loading.load_model(str(path))
    assert model.config.vocab_size == 32


def test_a_full_disk_is_named_before_the_copy_is_written(gguf, monkeypatch):
    """Too little room for the copy: the load warns how much it needs and has, reads the GGUF file
    and leaves no partial folder; converted_copy (for vLLM) raises a RuntimeError saying the same.
    A write that fails inside safetensors all the same is an OSError like any other."""
    from collections import namedtuple

    from safetensors import SafetensorError

    path, reads = gguf
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(loading.shutil, "disk_usage", lambda folder: usage(1 << 30, 1 << 30, 1 << 20))
    with pytest.warns(UserWarning, match=r"the copy needs \d+ MB and .* has 1 MB free"):
        model, _ = loading.load_model(str(path))
    assert model.config.vocab_size == 32 and reads == [torch.float32]
    assert not list(loading.converted_dir(path).parent.iterdir())[1:]  # the lock file only
    with pytest.raises(RuntimeError, match=r"could not write the converted copy of tiny.gguf .* 1 MB free"):
        loading.converted_copy(str(path))
    monkeypatch.setattr(loading.shutil, "disk_usage", lambda folder: usage(1 << 40, 0, 1 << 40))

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.warns(UserWarning, match="writing model.safetensors failed: .*No space left"):
        loading.load_model(str(path))
    assert reads == [torch.float32] * 3 and not (loading.converted_dir(path) / loading.CONVERTED_DONE).exists()


def test_dtype_auto_measures_once_per_model_and_says_which_in_one_line(gguf, caplog):
    """load_model(dtype="auto") through the converted copy: the first load measures and keeps its
    choice in $PROBE_MTP_CACHE_DIR, the second reads it and loads only the chosen configuration; each
    says which in one log line, and describe() says it too (which one wins on a tiny model is the
    machine's business: the choice itself is tested in test_choice.py)."""
    import logging

    from probe_mtp.choice import CONFIGURATIONS
    from probe_mtp.optimize import describe, is_optimized

    path, reads = gguf
    lines = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="probe_mtp"):
            model, _ = loading.load_model(str(path), dtype="auto")
        found = [r.getMessage() for r in caplog.records if r.name == "probe_mtp"]
        assert len(found) == 1 and found[0].startswith("dtype auto: ")
        lines.append(found[0])
        name = found[0].split(" (", 1)[0].removeprefix("dtype auto: ")
        assert (model.dtype, is_optimized(model)) == CONFIGURATIONS[name]
        assert f"; chosen by dtype auto: {name} (" in describe(model)
    assert "curves measured now in" in lines[0] and "curves measured at the first load" in lines[1]
    assert reads == [torch.float32]  # the GGUF file read once; the copy and the choice kept
    assert len(list(loading.cache_dir().glob("dtype-choice-*.json"))) == 1
    with pytest.raises(TypeError, match="auto"):
        loading.load_model(str(path), dtype="fastest")


def test_the_model_identity_changes_with_its_file(gguf, tmp_path):
    path, _ = gguf
    before = loading.model_identity(str(path))
    assert before["source"] == str(path.parent.resolve()) and before["files"][0][0] == "tiny.gguf"
    path.write_bytes(b"GGUF stand-in, another version")
    assert loading.model_identity(str(path)) != before
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert loading.model_identity(str(folder))["files"][0][:2] == ["config.json", 2]
    assert loading.model_identity("org/some-model") == {"source": "org/some-model"}


def test_a_copy_marked_as_gguf_quantized_loads_as_the_dense_model_it_is(gguf, tmp_path):
    """Copies written before the marking was dropped say ``quantization_config: gguf``; their
    weights are dense float32, and the model loads as a plain one: save_pretrained works and no
    warning about GGUF kernels is printed for a bf16 load."""
    import json

    path, _ = gguf
    loading.load_model(str(path))
    config_file = loading.converted_dir(path) / "config.json"
    config = json.loads(config_file.read_text())
    assert "quantization_config" not in config  # new copies are written unmarked
    assert config["architectures"] == ["LlamaForCausalLM"]  # other engines (vLLM) read it
    config["quantization_config"] = {"quant_method": "gguf", "dequantize": False, "gguf_file": "tiny.gguf"}
    del config["architectures"]  # as copies written before it was kept
    config_file.write_text(json.dumps(config))
    model, _ = loading.load_model(str(path))
    rewritten = json.loads(config_file.read_text())  # once, under the copy's lock
    assert "quantization_config" not in rewritten and rewritten["architectures"] == ["LlamaForCausalLM"]
    stamp = config_file.stat().st_mtime_ns
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = loading.load_model(str(path), dtype=dtype)
        assert getattr(model, "hf_quantizer", None) is None and model.dtype == dtype
        assert not hasattr(model.config, "quantization_config")
        model.save_pretrained(tmp_path / f"saved-{dtype}")
        ref = _tiny()[0].to(dtype).state_dict()
        assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)
    assert config_file.stat().st_mtime_ns == stamp  # an up-to-date copy is only read


def test_a_tied_embedding_is_stored_under_its_own_name_and_old_copies_are_renamed_once(gguf):
    """The copy stores a tied embedding as ``model.embed_tokens.weight`` (what transformers saves for
    tied models, and the name vLLM reads); a copy written before, which held it only as
    ``lm_head.weight``, is renamed once under the copy's lock and loads the same model bit for bit."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path, reads = gguf
    loading.load_model(str(path))
    weights = loading.converted_dir(path) / "model.safetensors"

    def stored():
        with safe_open(str(weights), framework="pt") as fh:
            return set(fh.keys()), fh.metadata(), {n: fh.get_tensor(n) for n in fh.keys()}

    names, meta, tensors = stored()
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert meta["lm_head.weight"] == "model.embed_tokens.weight"
    # as safetensors' save_model wrote it before: the tied tensor under the output layer's name
    old = {("lm_head.weight" if n == "model.embed_tokens.weight" else n): t for n, t in tensors.items()}
    save_file(old, str(weights), metadata={"format": "pt", "model.embed_tokens.weight": "lm_head.weight"})
    model, _ = loading.load_model(str(path))
    names, meta, renamed = stored()
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert all(torch.equal(renamed[n], tensors[n]) for n in tensors) and renamed.keys() == tensors.keys()
    ref = _tiny()[0].state_dict()
    assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    stamp = weights.stat().st_mtime_ns
    loading.load_model(str(path))
    assert weights.stat().st_mtime_ns == stamp and reads == [torch.float32]  # renamed once, never reconverted


def test_converted_copy_gives_the_folder_other_engines_read(gguf, tmp_path):
    """converted_copy (what probe_mtp.vllm serves): written at the first use, then only returned."""
    path, reads = gguf
    folder = loading.converted_copy(str(path))
    assert folder == loading.converted_dir(path) and (folder / loading.CONVERTED_DONE).is_file()
    assert loading.converted_copy(str(path)) == folder and reads == [torch.float32]
    model, _ = loading.load_model(str(folder))  # a plain Hugging Face folder
    ref = _tiny()[0].state_dict()
    assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ValueError, match="not a GGUF model"):
        loading.converted_copy(str(plain))


# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "xpu", "mps", "meta", "cudaa", "gpu"])
def test_a_device_this_machine_lacks_is_a_clear_error_before_anything_is_read(gguf, device):
    """Unless the machine has that accelerator (the suite may run on a GPU), loading on it is a
    ValueError naming the device and the available ones, raised before the model is read."""
    path, reads = gguf
    if any(device in (d, d.split(":")[0]) for d in loading.available_devices()):
        pytest.skip(f"this machine has {device}")
    with pytest.raises(ValueError, match=f"{device!r}.*available: cpu") as error:
        loading.load_model(str(path), device=device)
    assert reads == [] and "Traceback" not in str(error.value)
    assert loading.available_devices()[0] == "cpu"
    assert loading.resolve_device("cpu") == torch.device("cpu")


def test_a_bf16_load_on_the_cpu_holds_the_float32_weights_rounded(gguf, tmp_path):
    """``device="cpu"`` with ``dtype=torch.bfloat16``, through the converted copy and from a Hugging
    Face folder: every weight in bf16, equal to the float32 weight cast."""
    path, _ = gguf
    ref = _tiny()[0].state_dict()
    loading.load_model(str(path))  # writes the copy
    folder = tmp_path / "folder"
    model, tok = _tiny()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    for source in (str(path), str(folder)):
        for device in ("cpu", torch.device("cpu")):
            half, _ = loading.load_model(source, dtype=torch.bfloat16, device=device)
            weights = half.state_dict()
            assert half.device == torch.device("cpu") and {w.dtype for w in weights.values()} == {torch.bfloat16}
            assert all(torch.equal(weights[k], ref[k].to(torch.bfloat16)) for k in ref)
