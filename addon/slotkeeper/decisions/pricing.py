"""Saves, restores and seeds priced with what the server in use measured (issue #31). Pure.

A save or a restore runs on llama-server's main loop: while it moves a slot's bytes no other
slot produces a token. What it buys is a prefill not run again. On the test bed a 2k-token
slot saves in ~7 ms and re-prefills in ~13 s, so every rule below says "save, restore"; with a
real model on a GPU (128-320 KiB of KV a token, 10^3-10^4 tokens/s of prefill) a restore can
cost as much as the prefill it replaces, and then it does not pay. Each rule compares seconds:
bytes at the measured save or restore speed against tokens at the measured prefill speed. An
unknown speed (nothing measured yet on this server) counts as "it pays": the call then runs,
and measures it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Rates:
    """What one server measured (upstream/costs.py keeps them); None until measured.
    `samples`: answers and slot calls counted."""

    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    save_bytes_per_s: float | None = None
    restore_bytes_per_s: float | None = None
    kv_bytes_per_token: float | None = None
    slot_fixed_bytes: float | None = None  # a slot file's size at 0 tokens (the line's)
    samples: int = 0

    def as_dict(self) -> dict[str, float | int | None]:
        return {key: (round(value, 3) if isinstance(value, float) else value)
                for key, value in asdict(self).items()}

    def file_bytes(self, tokens: int) -> float | None:
        """A slot file's size for `tokens`, from the measured size line."""
        if self.kv_bytes_per_token is None:
            return None
        return (self.slot_fixed_bytes or 0.0) + tokens * self.kv_bytes_per_token

    def save_seconds(self, nbytes: float | None) -> float | None:
        return _seconds(nbytes, self.save_bytes_per_s)

    def restore_seconds(self, nbytes: float | None) -> float | None:
        return _seconds(nbytes, self.restore_bytes_per_s)

    def read_back_seconds(self, nbytes: float | None) -> float | None:
        """A restore's time for comparing it with another way back (the server's RAM cache),
        where an unknown one must not count as free: the restore speed, or while no restore
        has been measured on this server, the save speed (the same folder, the same bytes:
        1,190 ms restore against 1,320 ms save of one 10 MB file at the bench's cap).
        Counted as 0, it sent a session the RAM cache held to the disk in six-agents' first
        round of returns, before any restore had run: 1.2 s on its first token."""
        return self.restore_seconds(nbytes) or self.save_seconds(nbytes)

    def prefill_seconds(self, tokens: int) -> float | None:
        return _seconds(max(tokens, 0), self.prefill_tokens_per_s)


def _seconds(amount: float | None, per_second: float | None) -> float | None:
    if amount is None or not per_second:
        return None
    return amount / per_second


def restore_pays(rates: Rates, nbytes: float | None, tokens: int) -> bool:
    """Restore a snapshot of `tokens` (`nbytes` on disk) rather than prefill them again?

    Yes when reading it takes less than prefilling its tokens. Not counted, both on the side
    of the prefill: llama-server's own RAM cache may hold the prompt (not visible before the
    request: it would make the prefill cheaper still), and prefill gets slower per token as
    the context grows (the measured speed is an average over shorter prompts)."""
    restore, prefill = rates.restore_seconds(nbytes), rates.prefill_seconds(tokens)
    return restore is None or prefill is None or restore < prefill


def copy_pays(rates: Rates, tokens: int, useful_tokens: int) -> bool:
    """Save a session of `tokens` from its slot and restore it into another one, for a new
    conversation that will reuse `useful_tokens` of it (the parent's prefix), rather than
    prefill those? The parent keeps its slot: the copy's write and read are the cost."""
    nbytes = rates.file_bytes(tokens)
    save, restore = rates.save_seconds(nbytes), rates.restore_seconds(nbytes)
    prefill = rates.prefill_seconds(useful_tokens)
    return save is None or restore is None or prefill is None or save + restore < prefill


def save_pays(rates: Rates, tokens: int, saved_tokens: int, saved_bytes: float | None) -> bool:
    """Save a slot of `tokens` whose last snapshot holds `saved_tokens` (`saved_bytes`)?

    The save costs its write now (every other slot stalls meanwhile) and its read when the
    session comes back after losing its slot; without it, that return costs the cheaper of
    prefilling everything and restoring the old snapshot plus prefilling what it lacks. An
    unchanged slot never pays (nothing to gain, a write to spend)."""
    if tokens <= saved_tokens:
        return False
    costs = return_costs(rates, tokens, saved_tokens, saved_bytes)
    return costs is None or costs[0] < costs[1]


def return_costs(rates: Rates, tokens: int, saved_tokens: int,
                 saved_bytes: float | None) -> tuple[float, float] | None:
    """Seconds a session of `tokens` costs to save now and bring back later, and to bring back
    without this save (see save_pays); None while a speed is unknown."""
    nbytes = rates.file_bytes(tokens)
    save, restore = rates.save_seconds(nbytes), rates.restore_seconds(nbytes)
    prefill_all = rates.prefill_seconds(tokens)
    if save is None or restore is None or prefill_all is None:
        return None
    without = prefill_all
    old_restore = rates.restore_seconds(saved_bytes) if saved_tokens > 0 else None
    if old_restore is not None and restore_pays(rates, saved_bytes, saved_tokens):
        without = min(without, old_restore + (rates.prefill_seconds(tokens - saved_tokens)
                                              or 0.0))
    return save + restore, without


def save_now(predicted_stall: float | None, others_generating: bool, budget: float,
             quiet: bool = True, holds_answer: bool = False) -> bool:
    """May a save that need not happen now (idle, periodic) run now? The server writes a slot
    on its main loop, so while it does no other slot produces a token and no new request
    starts. A save whose predicted stall (its bytes at the measured save speed) fits the
    budget runs at once. Unknown (no save measured yet on this server) or longer: it runs only
    when the server is quiet: no other slot generating and nothing sent to or answered by it
    for a while (`quiet`), so that it delays nobody; never on an answer's path (`holds_answer`:
    a growth save after an answer, whose end waits for it). Measured at the bench's cap, a
    first save of 5,880 tokens held an answer's end 3.9 s, another one stopped a stream for
    3.8 s, and one started between two agents' turns (nobody generating, not quiet) held the
    next turn 1.4 s."""
    if predicted_stall is None:  # not measured yet: as long as any, for all we know
        return not holds_answer and not others_generating and quiet
    if predicted_stall <= budget:
        return True
    return not holds_answer and not others_generating and quiet


def within_write_budget(written_last_hour: float, nbytes: float | None, budget: float) -> bool:
    """May a save that can wait write `nbytes` more, `written_last_hour` already written into
    the slot folder within the hour? `budget` 0: no limit. An unknown size counts as 0."""
    return budget <= 0 or written_last_hour + (nbytes or 0.0) <= budget
