"""``probe-mtp report``: the default configuration against the two transformers baselines first
(verdict line; on a model prepared by :func:`probe_mtp.optimize` also against ``model.generate`` on
the unprepared float32 model), then every drafter at an equal block complexity, side by side in one
run.

- :mod:`.harness`: the methods (the default configuration, probe-mtp drafters, ``model.generate``
  greedy, transformers' prompt lookup), the prompt-major timing loop and the per-prompt records;
- :mod:`.streams`: the prompt streams (Spec-Bench in order, each prompt twice, conversations);
- :mod:`.summary`: aggregation per Spec-Bench task and overall (tau, tokens/s, speedups with 95%
  intervals, lossless), the verdict line;
- :mod:`.outputs`: report.json, records.csv, summary.md and the terminal tables;
- :mod:`.plots`: PNG figures (matplotlib, Agg canvas, no pyplot state);
- :mod:`.cli`: the ``report`` subcommand.
"""

from .harness import (
    BASELINES,
    DEFAULT,
    GREEDY,
    GREEDY_FP32,
    HF_PLD,
    Report,
    ReportSettings,
    available_methods,
    resolve_methods,
    run_report,
    select_prompts,
)
from .outputs import write_outputs
from .summary import summarize

__all__ = [
    "BASELINES",
    "DEFAULT",
    "GREEDY",
    "GREEDY_FP32",
    "HF_PLD",
    "Report",
    "ReportSettings",
    "available_methods",
    "resolve_methods",
    "run_report",
    "select_prompts",
    "summarize",
    "write_outputs",
]
