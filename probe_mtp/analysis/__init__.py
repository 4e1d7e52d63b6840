"""Why probing works: how closely a mask's hidden state matches the hidden state of the true future
token, layer by layer, and whether the true token is then among the mask's proposals.

- :mod:`.alignment`: the measurement on one greedy continuation (definitions in its docstring);
- :mod:`.table`: the tidy table (numpy structured rows, ``to_pandas()`` optional);
- :mod:`.study`: prompts x mask settings, with the decoder's own tau per setting;
- :mod:`.summaries`: per-layer means, hit rates against cosine, the threshold where hits become likely;
- :mod:`.plots`: the figures of ``notebooks/cosine_alignment.ipynb``.
"""

from .alignment import PromptAlignment, align_masks
from .study import AlignmentStudy, mask_init_settings, run_alignment_study
from .summaries import HitRates, LayerCurve, cosine_by_outcome, hit_rates, hit_threshold, layer_curve
from .table import TABLE_DTYPE, AlignmentTable

__all__ = [
    "PromptAlignment",
    "align_masks",
    "AlignmentStudy",
    "mask_init_settings",
    "run_alignment_study",
    "AlignmentTable",
    "TABLE_DTYPE",
    "LayerCurve",
    "HitRates",
    "layer_curve",
    "cosine_by_outcome",
    "hit_rates",
    "hit_threshold",
]
