"""The two transformers baselines every report measures beside the probe-mtp methods, the float32
baseline a report on a prepared model adds, and the name of the default configuration's row."""

GREEDY = "generate"
"""``model.generate(do_sample=False)``: the reference (tau = 1 by definition).  On a model prepared
by :func:`probe_mtp.optimize` it runs on the prepared model (bf16, the same kernels probe-mtp runs
on), and every method's ``identical_to_greedy`` is judged against it."""
HF_PLD = "hf-pld"
"""transformers' own prompt lookup, ``model.generate(do_sample=False, prompt_lookup_num_tokens=10)``."""
BASELINES = (GREEDY, HF_PLD)
GREEDY_FP32 = "generate fp32"
"""``model.generate(do_sample=False)`` on the unprepared float32 model (stock kernels), measured only
when the loaded model is prepared (:func:`probe_mtp.optimize`) and a float32 copy of it is given
(``reference_model``): the speed a user had before preparing the model.  Its records compare its
outputs with :data:`GREEDY` on the prepared model, so their ``identical_to_greedy`` and
``agreement`` say how often stock float32 and prepared bf16 decoding agree (a difference there is
rounding, not a loss of probe-mtp's: every method is exact against the prepared model)."""
DEFAULT = "default"
"""The default configuration, exactly as ``probe_mtp.generate(model, ids)`` runs it:
``ProbeDecoder(model, tokenizer)`` (drafter ``hybrid``, ``budget="auto"``, ``masks="auto"``, a
drafting memory kept across requests)."""
