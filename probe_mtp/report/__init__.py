"""``probe-mtp report``: every method and the two transformers baselines, side by side in one run.

- :mod:`.harness`: the methods (probe-mtp drafters, ``model.generate`` greedy, transformers' prompt
  lookup), the prompt-major timing loop and the per-prompt records;
- :mod:`.summary`: aggregation per Spec-Bench task and overall (tau, tokens/s, speedups, lossless);
- :mod:`.outputs`: report.json, records.csv, summary.md and the terminal table;
- :mod:`.plots`: PNG figures (matplotlib, Agg canvas, no pyplot state);
- :mod:`.cli`: the ``report`` subcommand.
"""

from .harness import (
    BASELINES,
    GREEDY,
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
    "GREEDY",
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
