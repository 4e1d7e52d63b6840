"""The two transformers baselines every report measures beside the probe-mtp methods, and the name
of the default configuration's row."""

GREEDY = "generate"
"""``model.generate(do_sample=False)``: the reference (tau = 1 by definition)."""
HF_PLD = "hf-pld"
"""transformers' own prompt lookup, ``model.generate(do_sample=False, prompt_lookup_num_tokens=10)``."""
BASELINES = (GREEDY, HF_PLD)
DEFAULT = "default"
"""The default configuration, exactly as ``probe_mtp.generate(model, ids)`` runs it:
``ProbeDecoder(model, tokenizer)`` (drafter ``hybrid``, ``budget="auto"``, ``masks="auto"``, a
drafting memory kept across requests)."""
