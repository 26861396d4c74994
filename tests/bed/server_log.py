"""What llama-server itself says it did, read from its log (b11434, default verbosity): which
slot ran each task, how that slot was chosen, and how many prompt tokens it computed.

    slot get_availabl: id  2 | task -1 | selected slot by id (2)
    slot launch_slot_: id  2 | task 14 | processing task, is_child = 0
    slot print_timing: id  2 | task 14 | prompt eval time =   20920.13 ms /   645 tokens (...)
    slot      release: id  2 | task 14 | stop processing: n_tokens = 677, truncated = 0

"selected slot by id" is the only choice that honours the request's id_slot; the others are
"by LCP similarity, ..." and "by LRU, ...". The tests trust these lines over anything the
proxy reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"slot\s+(?P<what>\w+): id\s+(?P<slot>\d+) \| task (?P<task>-?\d+) \| (?P<rest>.*)")
_SELECTED = re.compile(r"selected slot by (?P<how>id|LCP similarity|LRU|[\w ]+?)\b")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(?P<n>\d+) tokens")
_RELEASE = re.compile(r"stop processing: n_tokens = (?P<n>\d+)")


@dataclass
class Task:
    task: int
    slot: int
    selected_by: str  # "id", "LCP similarity", "LRU", or "?" when the line was not seen
    prompt_evaluated: int | None = None  # prompt tokens computed (the response's prompt_n)
    tokens_at_release: int | None = None  # what the slot holds after it: prompt + generated


def tasks(log_text: str) -> list[Task]:
    """Every completion task in the log, in start order."""
    selected: dict[int, str] = {}  # slot -> how it was chosen for the next launch on it
    found: dict[int, Task] = {}
    for line in log_text.splitlines():
        match = _LINE.search(line)
        if match is None:
            continue
        slot, task, rest = int(match["slot"]), int(match["task"]), match["rest"]
        if match["what"] == "get_availabl":
            how = _SELECTED.search(rest)
            if how is not None:
                selected[slot] = how["how"].strip()
        elif match["what"] == "launch_slot_":
            found[task] = Task(task, slot, selected.pop(slot, "?"))
        elif task in found:
            evaluated = _PROMPT_EVAL.search(rest)
            if evaluated is not None:
                found[task].prompt_evaluated = int(evaluated["n"])
            released = _RELEASE.search(rest)
            if released is not None:
                found[task].tokens_at_release = int(released["n"])
    return list(found.values())
