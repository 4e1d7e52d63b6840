"""Prompt streams: the order in which a report or a bench asks its prompts, and what each turn carries.

A stream is a list of conversations; a conversation is a list of user turns that share their
history: each turn's prompt is every earlier turn of the conversation followed by the model's own
``model.generate`` greedy answer to it (which every lossless method reproduces, so every method
sees the same prompts).  The harness runs the conversations in order, so a decoder that keeps a
drafting memory across requests (one decoder per method for the whole stream) sees them in the
order a user's long-running process would.

- ``specbench`` (default): the Spec-Bench prompts in order; MT-bench's two turns form one
  conversation, every other prompt is a conversation of one turn.
- ``repeat``: the same, with every turn asked twice in a row (the second ask has the same prompt
  as the first): what a decoder learns from a request, measured on the same request again.
- ``conversation``: one conversation per task, chaining the task's prompts (every turn of each) as
  successive user turns with the model's own greedy answers as assistant turns: a multi-turn chat
  whose context carries every earlier question and answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..prompts import Prompt

STREAMS = ("specbench", "repeat", "conversation")
DEFAULT_STREAM = "specbench"


@dataclass(frozen=True)
class StreamTurn:
    """One user turn of a stream.  ``turn``: its position in its conversation (1 = first);
    ``ask``: 1, or 2 for the second ask of the same prompt (``repeat``)."""

    prompt: Prompt
    turn: int
    text: str
    ask: int = 1

    @property
    def task(self) -> str:
        return self.prompt.task


@dataclass(frozen=True)
class Conversation:
    task: str
    turns: tuple[StreamTurn, ...]


def check_stream(kind: str) -> str:
    if kind not in STREAMS:
        raise ValueError(f"unknown stream {kind!r}; choose one of: {', '.join(STREAMS)}")
    return kind


def build_stream(prompts: list[Prompt], kind: str = DEFAULT_STREAM) -> list[Conversation]:
    """The conversations of stream ``kind`` over ``prompts`` (see the module docstring)."""
    check_stream(kind)
    if kind == "conversation":
        by_task: dict[str, list[Prompt]] = {}
        for p in prompts:
            by_task.setdefault(p.task, []).append(p)
        out = []
        for task, members in by_task.items():
            texts = [(p, text) for p in members for text in p.turns]
            out.append(Conversation(task, tuple(StreamTurn(p, i, text) for i, (p, text) in enumerate(texts, 1))))
        return out
    asks = (1, 2) if kind == "repeat" else (1,)
    return [
        Conversation(p.task, tuple(StreamTurn(p, i, text, ask) for i, text in enumerate(p.turns, 1) for ask in asks))
        for p in prompts
    ]


def stream_turns(stream: list[Conversation]) -> int:
    """How many generations one method runs over the stream."""
    return sum(len(c.turns) for c in stream)
