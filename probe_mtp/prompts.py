"""Prompt sets: the bundled Spec-Bench questions (or any file in the same JSONL format) and chat
formatting."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class Prompt:
    question_id: int
    category: str
    turns: tuple[str, ...]

    @property
    def task(self) -> str:
        """Spec-Bench task: the MT-bench categories fold into ``mt_bench``."""
        return "mt_bench" if self.category in MT_BENCH_CATEGORIES else self.category


def bundled_specbench_path() -> Path:
    return Path(str(resources.files("probe_mtp") / "data" / "specbench" / "question.jsonl"))


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Read a Spec-Bench-format JSONL file (default: the bundled Spec-Bench questions).

    Each line: ``{"question_id": int, "category": str, "turns": [str, ...]}``; ``question_id``
    and ``category`` may be missing (then the line number and ``"custom"`` are used).
    """
    source = Path(path) if path is not None else bundled_specbench_path()
    if not source.is_file():
        raise FileNotFoundError(f"prompt file not found: {source}")
    prompts = []
    with source.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{source}:{lineno}: not valid JSON ({exc.msg})") from None
            turns = row.get("turns")
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError(f"{source}:{lineno}: 'turns' must be a non-empty list of non-empty strings")
            prompts.append(Prompt(int(row.get("question_id", lineno)), str(row.get("category", "custom")), tuple(turns)))
    if not prompts:
        raise ValueError(f"{source} holds no prompts")
    return prompts


def balanced_subset(prompts: list[Prompt], per_task: int, tasks: tuple[str, ...] | None = None) -> list[Prompt]:
    """The first ``per_task`` prompts of each task, spread over the task's categories (so that
    mt_bench draws from its eight categories in turn), in task order."""
    by_task: dict[str, dict[str, list[Prompt]]] = {}
    for p in prompts:
        by_task.setdefault(p.task, {}).setdefault(p.category, []).append(p)
    wanted = tasks or tuple(t for t in TASKS if t in by_task) + tuple(t for t in by_task if t not in TASKS)
    out = []
    for task in wanted:
        cats = list(by_task.get(task, {}).values())
        picked: list[Prompt] = []
        i = 0
        while len(picked) < per_task and any(i < len(c) for c in cats):
            for c in cats:
                if i < len(c) and len(picked) < per_task:
                    picked.append(c[i])
            i += 1
        out.extend(picked)
    return out


def chat_input_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """``[1, L]`` token ids of a conversation, with the tokenizer's chat template when it has one
    (otherwise the turns joined as plain text)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        if not isinstance(ids, torch.Tensor):
            ids = ids["input_ids"]
        return ids
    text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    return tokenizer(text, return_tensors="pt")["input_ids"]
