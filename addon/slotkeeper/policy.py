"""The routing policy: pure decisions, no I/O, no clock, no locks. Each function answers one
question the router asks on a request's walk; docs/DESIGN.md ("Rooms" and "Conversations")
gives the reasons and the traffic that forced each rule.

- which conversation a content-identified request continues (`resolve_content`);
- whether a request of a known session is its main conversation, a side request, or a main
  conversation that must move off its own busy slot (`classify`);
- whether a slot's KV is worth saving (`worth_saving`, `grew_enough`);
- which slot a request that claims nothing may use (`order_for_side`);
- what a server's settings tell the user (`advice`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# What classify() answers.
MAIN = "main"  # the session's conversation: it keeps, takes or is restored into its slot
SIDE = "side"  # not the session's conversation (a title, a tag, a summary): any free slot, no claim
MOVE = "move"  # the session's new main conversation while its slot runs the session's other one

# "A prefix much shorter than what the slot holds": a request under half the characters of the
# resident conversation that does not extend it cannot be its next turn. A compaction that
# rewrites the history to a summary is the one legitimate shrink; it keeps far more than half
# of the prompt in the traffic we have (the system prompt and tools alone are most of it).
SHRINK_RATIO = 0.5


@dataclass(frozen=True)
class Conversation:
    """What a slot holds for its session, as far as routing needs to know: enough to tell
    whether a request continues it. `head` is the request's chain hash after `length` items
    (the system block, then each message); "" when unknown (a record from an older proxy)."""

    system_key: str | None
    length: int
    head: str
    chars: int

    @classmethod
    def of(cls, chain: Sequence[str], system_key: str | None, chars: int) -> Conversation:
        return cls(system_key, len(chain), chain[-1] if chain else "", chars)


def extends(chain: Sequence[str], conversation: Conversation) -> bool:
    """Does a request with this message chain continue the conversation (its first
    `length` items are exactly the conversation's)? An unknown conversation is taken as
    continued: that is what the router did before it recorded chains."""
    if not conversation.head:
        return True
    n = conversation.length
    return 0 < n <= len(chain) and chain[n - 1] == conversation.head


def resolve_content(base: str, chain: Sequence[str],
                    known: Mapping[str, Conversation]) -> str:
    """The session of a content-identified request. `base` is the id identity derived from
    the conversation's start (model, system prompt, first user message); `known` holds the
    conversations already seen under that start (session id -> its last conversation).

    The request continues the longest known conversation it extends. Otherwise it is a new
    conversation with the same opening: the first one seen gets `base` itself, later ones a
    fork `base.<hash of the request's chain>`, so two conversations that open alike never
    share a session (and overwrite each other's snapshot)."""
    best, best_length = None, -1
    for session, conversation in known.items():
        if conversation.head and extends(chain, conversation) and conversation.length > best_length:
            best, best_length = session, conversation.length
    if best is not None:
        return best
    if base not in known or not chain:
        return base
    return f"{base}.{chain[-1][:8]}"


def classify(*, chain: Sequence[str], system_key: str | None, prompt_chars: int,
             small_request_chars: int, resident: Conversation | None,
             own_request_running: bool) -> str:
    """Is this request the session's main conversation (MAIN), a side request (SIDE), or the
    session's main conversation arriving while its slot still runs another request of the
    same session (MOVE: take a fresh slot instead of queueing behind it)?

    - Small prompts are side requests (titles, tags, a first "hi"): cheap to prefill anywhere.
    - A request that extends the resident conversation is its next turn.
    - A different system prompt and a smaller prompt than the slot holds: another task of the
      same client (OpenCode's title request carries the session's id and its own system prompt).
    - Less than half the resident prompt and not an extension: a side request too.
    - Anything else rewrote the conversation (compaction, an edited history): it is the main
      conversation now.
    Two requests of one session never queue on one slot: a continuation that finds its slot
    busy with the session's own request is placed as a side request; a new main conversation
    moves to a slot of its own. The one exception is a retry: the running request itself
    again (same conversation, same length) waits for it on its slot."""
    if prompt_chars < small_request_chars:
        return SIDE
    if resident is None:
        return MOVE if own_request_running else MAIN
    if extends(chain, resident):
        if own_request_running and resident.head and len(chain) == resident.length:
            # The very request that is running, again: a client's retry (an SDK that gave
            # up waiting, X-Stainless-Retry-Count). It goes where the original went and
            # reuses what the original prefilled there (issue #23).
            return MAIN
        return SIDE if own_request_running else MAIN
    if system_key != resident.system_key and prompt_chars < resident.chars:
        return SIDE
    if prompt_chars < resident.chars * SHRINK_RATIO:
        return SIDE
    return MOVE if own_request_running else MAIN


# What a request that claims no slot (a side request, a one-off) costs each slot's owner.
FREE = 0  # nobody's KV: no claim, or a stale one
CURRENT = 1  # the owner's snapshot holds what the slot holds: it pays one restore, nothing lost
SAVE = 2  # the owner grew since its snapshot: saved first (the request waits for that save)


def order_for_side(ranking: Sequence[int], costs: Mapping[int, tuple[bool, int]]) -> list[int]:
    """The slots a request that claims nothing tries, in order (issue #23): idle before busy,
    then a free slot, else one whose owner's snapshot is current, and only then one whose
    owner must be saved first; `ranking`'s order (choice.rank_slots) within each. `costs`:
    slot -> (processing, FREE | CURRENT | SAVE); a slot missing from it is taken as busy."""
    position = {slot: i for i, slot in enumerate(ranking)}
    return sorted(ranking, key=lambda slot: (*costs.get(slot, (True, SAVE)), position[slot]))


# What verify_slot() answers.
VERIFIED = "yes"  # /slots shows the pinned slot holding exactly the request's tokens
BY_REUSE = "reuse"  # the server reused the slot's prefix: it ran where that prefix was
UNKNOWN = "unknown"  # the slots changed since (a next request): cannot tell
MISMATCH = "no"


def needs_slot_check(*, expected_prefix: int, cache_n: int) -> bool:
    """Reading /slots after every answer costs a round trip; a request that reused at least
    half of the prefix its slot held for it ran on a slot holding that prefix: ours (a
    similarity pick elsewhere would need the same prefix there too). Only the others are
    checked: cold slots (assigned), and reuse far below what the slot held."""
    return not (expected_prefix > 0 and cache_n >= expected_prefix // 2)


def verify_slot(pinned: int, tokens_after: int, slots: Sequence[tuple[int, int, bool]]
                ) -> tuple[str, int | None]:
    """Which slot ran a request, from /slots read right after its answer: `slots` holds
    (id, tokens in the slot, processing). A slot that ran the request holds its prompt plus
    the generated tokens but the last (`tokens_after`, measured: 28 prompt + 3 generated
    leave 30). Returns (VERIFIED, pinned), (MISMATCH, the slot that ran it) or (UNKNOWN,
    None) when no idle slot, or more than one, matches."""
    idle = {slot: tokens for slot, tokens, busy in slots if not busy}
    if idle.get(pinned) == tokens_after:
        return VERIFIED, pinned
    matches = [slot for slot, tokens in idle.items() if tokens == tokens_after and slot != pinned]
    if len(matches) == 1 and pinned in idle:
        return MISMATCH, matches[0]
    return UNKNOWN, None


def worth_saving(tokens: int, saved_tokens: int, min_save_tokens: int) -> bool:
    """A slot is worth a (new) snapshot when it is big enough that re-prefilling it costs more
    than a file (min_save_tokens) and holds more than its last snapshot."""
    return tokens >= min_save_tokens and tokens > saved_tokens


def grew_enough(tokens: int, saved_tokens: int, min_save_tokens: int,
                save_every_tokens: int) -> bool:
    """A session that keeps its slot is saved again once it grew this much since its last
    save, so a crash loses at most that much prefill."""
    return tokens >= min_save_tokens and tokens - saved_tokens >= save_every_tokens


def advice(*, url: str, total_slots: int, slots_readable: bool) -> list[str]:
    """Warnings about server settings that defeat slotkeeper, said once per upstream.

    Not said any more (issue #11, fault 8):
    - `-np 1`: one slot holding the whole context, sessions swapped through disk, is a real
      and deliberate setup (it works, measured); slotkeeper serves it.
    - "every slot has the model's whole training context, so the KV cache looks unified":
      /props does not say whether the cache is unified, and an explicit `-np 4 -c 131072` on a
      32k model looks exactly the same. The symptom that matters (idle slots cleared by
      --cache-idle-slots) is caught where it happens: a slot we hold as resident reports 0
      tokens, and the router says so then (Router._verify)."""
    out = []
    if not slots_readable:
        out.append(f"{url}: GET /slots is disabled or failing (--no-slots?): slotkeeper can "
                   f"only hash sessions over the slot count")
    del total_slots  # kept in the signature: the caller passes what it knows
    return out
