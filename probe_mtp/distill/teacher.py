"""The teacher of self-distillation: the frozen model's own greedy continuations of training prompts.

Training prompts come from a Spec-Bench-format JSONL file (first turns) or a plain text file (one
prompt per non-empty line); the default is the bundled Spec-Bench tasks translation, summarization
and qa.  Every prompt is formatted with the chat template, continued greedily by the model, and kept
as one token sequence ``prompt + continuation``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..prompts import balanced_subset, chat_input_ids, load_prompts

DEFAULT_TASKS = ("translation", "summarization", "qa")


@dataclass(frozen=True)
class TrainingPrompt:
    task: str
    text: str


@dataclass(frozen=True)
class TeacherSequence:
    """``ids``: 1D prompt + greedy continuation; the continuation starts at ``prompt_len``."""

    task: str
    ids: torch.Tensor
    prompt_len: int

    @property
    def continuation_len(self) -> int:
        return int(self.ids.shape[0]) - self.prompt_len


def _is_jsonl(path: Path) -> bool:
    if path.suffix == ".jsonl":
        return True
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                return line.lstrip().startswith("{")
    return False


def training_prompts(path: str | Path | None = None, tasks: tuple[str, ...] | None = None, per_task: int = 0) -> list[TrainingPrompt]:
    """The prompts to distill on.

    ``path``: None (the bundled Spec-Bench), a Spec-Bench-format JSONL file, or a text file with one
    prompt per line.  ``tasks`` (JSONL only): which tasks (default: translation, summarization, qa
    for the bundled file, every task for another file).  ``per_task``: prompts per task, balanced
    over categories (0: all).
    """
    if path is not None:
        source = Path(path)
        if not source.is_file():
            raise FileNotFoundError(f"training prompt file not found: {source}")
        if not _is_jsonl(source):
            if tasks:
                raise ValueError("--tasks applies to Spec-Bench JSONL prompt files, not to plain text files")
            lines = [line.strip() for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
            if not lines:
                raise ValueError(f"{source} holds no prompts")
            chosen = lines[:per_task] if per_task else lines
            return [TrainingPrompt("text", line) for line in chosen]
    prompts = load_prompts(path)
    present = sorted({p.task for p in prompts})
    wanted = tuple(tasks) if tasks else (DEFAULT_TASKS if path is None else tuple(present))
    unknown = [t for t in wanted if t not in present]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; the prompt file has: {', '.join(present)}")
    chosen = balanced_subset(prompts, per_task or len(prompts), wanted)
    return [TrainingPrompt(p.task, p.turns[0]) for p in chosen]


def context_limit(model, num_masks: int, max_context: int) -> int:
    """The longest teacher sequence (prompt + continuation) the training pass can take: the user's
    limit, and for sliding-window models the window (the whole sequence must stay in every layer's
    cache, with the masks of its last owner)."""
    window = getattr(model.config, "sliding_window", None)
    layer_types = getattr(model.config, "layer_types", None) or ()
    if window and any("sliding" in str(t) for t in layer_types):
        return min(max_context, int(window) - 1 - num_masks)
    return max_context


def teacher_key(identity: str, prompts: list[TrainingPrompt], max_new_tokens: int, max_context: int) -> str:
    """Identifies one set of teacher sequences (for reuse from a cache file)."""
    h = hashlib.sha256()
    h.update(json.dumps([identity, max_new_tokens, max_context, [(p.task, p.text) for p in prompts]]).encode())
    return h.hexdigest()[:20]


@torch.no_grad()
def teacher_sequences(
    model,
    tokenizer,
    prompts: list[TrainingPrompt],
    max_new_tokens: int,
    max_context: int,
    on_sequence: Callable[[int, TeacherSequence | None], None] | None = None,
) -> list[TeacherSequence]:
    """Greedy continuations (``model.generate(do_sample=False)``) of every prompt.  Prompts whose
    chat-formatted ids leave less than 2 continuation tokens within ``max_context`` are skipped
    (``on_sequence(i, None)``)."""
    out: list[TeacherSequence] = []
    for i, prompt in enumerate(prompts):
        ids = chat_input_ids(tokenizer, [{"role": "user", "content": prompt.text}]).to(model.device)
        room = min(max_new_tokens, max_context - ids.shape[1])
        seq = None
        if room >= 2:
            full = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=room)
            if full.shape[1] - ids.shape[1] >= 2:
                seq = TeacherSequence(prompt.task, full[0].cpu(), int(ids.shape[1]))
                out.append(seq)
        if on_sequence is not None:
            on_sequence(i, seq)
    if not out:
        raise ValueError(
            f"no training prompt fits the context limit of {max_context} tokens with at least 2 continuation tokens"
        )
    return out


def save_teachers(path: Path, key: str, sequences: list[TeacherSequence]) -> None:
    doc = {"key": key, "sequences": [{"task": s.task, "ids": s.ids.tolist(), "prompt_len": s.prompt_len} for s in sequences]}
    path.write_text(json.dumps(doc), encoding="utf-8")


def load_teachers(path: Path, key: str) -> list[TeacherSequence] | None:
    """The sequences saved under ``key`` in ``path``, or None (missing file or other settings)."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, OSError):
        return None
    if doc.get("key") != key:
        return None
    return [TeacherSequence(s["task"], torch.tensor(s["ids"], dtype=torch.long, device="cpu"), int(s["prompt_len"])) for s in doc["sequences"]]
