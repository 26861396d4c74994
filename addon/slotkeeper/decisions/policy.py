"""The routing policy: pure decisions, no I/O, no clock, no locks. Each function answers one
question the router asks on a request's walk; docs/DESIGN.md ("Rooms" and "Conversations")
gives the reasons and the traffic that forced each rule.

- which conversation a content-identified request continues (`resolve_content`), by extension
  or by the longest common prefix (`common_prefix`);
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


def common_prefix(chain: Sequence[str], other: Sequence[str]) -> int:
    """How many leading items two chains share. The hashes are cumulative, so the first
    difference ends the common part: a binary search would do, a linear one is as fast for
    the lengths seen (tens to hundreds of items) and simpler to check."""
    n = 0
    for mine, theirs in zip(chain, other):
        if mine != theirs:
            break
        n += 1
    return n


# A content request that extends no known conversation continues the one it shares the most
# of, when it shares at least the system block and the first message and is longer than that
# conversation was: an agent that rebuilds its prompt each turn (issue #19). A shorter or equal
# one is a new conversation with the same opening (a fork: fault 5), which never takes the
# other's slot.
MIN_CONTINUED_PREFIX = 2


def resolve_content(base: str, chain: Sequence[str], known: Mapping[str, Conversation],
                    chains: Mapping[str, Sequence[str]] | None = None) -> str:
    """The session of a content-identified request. `base` is the id identity derived from
    the conversation's start (model, system prompt, first user message); `known` holds the
    conversations already seen under that start (session id -> its last conversation);
    `chains` the full chains of those this process remembers.

    The request continues the longest known conversation it extends; else the one whose
    prompt it rebuilt (`rebuilt_from`). Otherwise it is a new conversation with the same
    opening: the first one seen gets `base` itself, later ones a fork `base.<hash of the
    request's chain>`, so two conversations that open alike never share a session (and
    overwrite each other's snapshot)."""
    best, best_length = None, -1
    for session, conversation in known.items():
        if conversation.head and extends(chain, conversation) and conversation.length > best_length:
            best, best_length = session, conversation.length
    if best is not None:
        return best
    rebuilt = rebuilt_from(chain, known, chains or {})
    if rebuilt is not None:
        return rebuilt
    if base not in known or not chain:
        return base
    return f"{base}.{chain[-1][:8]}"


def rebuilt_from(chain: Sequence[str], known: Mapping[str, Conversation],
                 chains: Mapping[str, Sequence[str]]) -> str | None:
    """The known conversation this request rebuilt, if any: it extends none, shares at least
    MIN_CONTINUED_PREFIX items with one and is longer than it was (the longest common prefix
    wins). A shorter or equal request is a new conversation with the same opening."""
    found, best = None, MIN_CONTINUED_PREFIX - 1
    for session, other in chains.items():
        conversation = known.get(session)
        if conversation is None or len(chain) <= conversation.length:
            continue
        n = common_prefix(chain, other)
        if n > best:
            found, best = session, n
    return found


def classify(*, chain: Sequence[str], system_key: str | None, prompt_chars: int,
             small_request_chars: int, resident: Conversation | None,
             own_request_running: bool, rewrites: bool = False,
             common_chars: int | None = None, last_side: Conversation | None = None,
             side_task: bool = False) -> str:
    """Is this request the session's main conversation (MAIN), a side request (SIDE), or the
    session's main conversation arriving while its slot still runs another request of the
    same session (MOVE: take a fresh slot instead of queueing behind it)?

    - Small prompts are side requests (titles, tags, a first "hi"): cheap to prefill anywhere.
    - So is a side task by what it asks (`side_task`, tasks.py: a title, tags, follow-ups),
      whatever its size and whether or not it arrived before the session's conversation.
    - A request that extends the resident conversation is its next turn; so is one that
      sessions resolved as the same agent's rebuilt prompt (`rewrites`).
    - A request that extends the session's last side request (by divergence, below) and is
      longer: the conversation changed course there (an edited message, then its next turn).
    - A different system prompt and a smaller prompt than the slot holds: another task of the
      same client (OpenCode's title request carries the session's id and its own system prompt).
    - Less than half the resident prompt and not an extension: a side request too.
    - The same system prompt, but sharing (`common_chars`: the characters of the chain prefix
      it has in common with the resident conversation, when known) less than half of the
      resident prompt: it does not continue what the slot holds (a chat UI's title request
      carrying the chat's id and a transcript of it, issue #19); a side request. With another
      system prompt the sizes decide (above): a bigger request is the main conversation even
      when the smaller one (OpenCode's title) came first and holds the slot.
    - Anything else rewrote the conversation (compaction keeps the system prompt and tools,
      most of the prompt): it is the main conversation now.
    Two requests of one session never queue on one slot: a continuation that finds its slot
    busy with the session's own request is placed as a side request (the router first waits
    briefly for a request that already sent its final event); a new main conversation moves
    to a slot of its own. The one exception is a retry: the running request itself again
    (same conversation, same length) waits for it on its slot."""
    if prompt_chars < small_request_chars or side_task:
        return SIDE
    if resident is None:
        return MOVE if own_request_running else MAIN
    if (own_request_running and resident.head and len(chain) == resident.length
            and extends(chain, resident)):
        # The very request that is running, again: a client's retry (an SDK that gave up
        # waiting, X-Stainless-Retry-Count). It goes where the original went and reuses what
        # the original prefilled there (issue #23).
        return MAIN
    if rewrites or extends(chain, resident):
        return SIDE if own_request_running else MAIN
    if (last_side is not None and last_side.head and len(chain) > last_side.length
            and extends(chain, last_side)):
        return MOVE if own_request_running else MAIN
    if system_key != resident.system_key and prompt_chars < resident.chars:
        return SIDE
    if prompt_chars < resident.chars * SHRINK_RATIO:
        return SIDE
    if (common_chars is not None and system_key == resident.system_key
            and common_chars < resident.chars * SHRINK_RATIO):
        return SIDE
    return MOVE if own_request_running else MAIN


# What a request that claims no slot (a side request, a one-off) costs each slot's owner.
FREE = 0  # nobody's KV: no claim, or a stale one
CURRENT = 1  # the owner's snapshot holds what the slot holds: it pays one restore, nothing lost
SAVE = 2  # the owner grew since its snapshot: saved first (the request waits for that save)


def order_for_side(ranking: Sequence[int], costs: Mapping[int, tuple[bool, int]],
                   tokens: Mapping[int, int] | None = None) -> list[int]:
    """The slots a request that claims nothing tries, in order (issue #23): idle before busy,
    then a free slot, else one whose owner's snapshot is current, and only then one whose
    owner must be saved first; `ranking`'s order (choice.rank_slots) within each. `costs`:
    slot -> (processing, FREE | CURRENT | SAVE); a slot missing from it is taken as busy.
    `tokens` (slot -> cached tokens): among idle free slots, one holding something comes
    before an empty one (issue #32, item 7b): llama-server consults its RAM prompt cache for
    a pinned request only when the slot holds something (on an empty one its keep ratio is
    0/0), and it parks what the slot held in that cache as it does so, so nothing is lost."""
    position = {slot: i for i, slot in enumerate(ranking)}
    tokens = tokens or {}

    def key(slot: int) -> tuple[int, int, int, int]:
        processing, cost = costs.get(slot, (True, SAVE))
        empty_free = int(not processing and cost == FREE and tokens.get(slot, 0) == 0)
        return int(processing), cost, empty_free, position[slot]

    return sorted(ranking, key=key)


def side_goes_unpinned(slot: int, costs: Mapping[int, tuple[bool, int]],
                       tokens: Mapping[int, int]) -> bool:
    """Send a request that claims nothing without `id_slot` (issue #32, item 7b) when the slot
    it would be pinned to is empty and every slot of the server is idle and free: pinned to an
    empty slot it would skip llama-server's RAM prompt cache, and unpinned the server can only
    pick a slot that holds nobody's KV, so the request gets exactly what the server alone
    would give it. (The caller holds every slot's lock meanwhile.)"""
    if tokens.get(slot, 0) != 0 or not costs:
        return False
    return all(not processing and cost == FREE for processing, cost in costs.values())


# A snapshot restored as another conversation's prefix is reused by llama-server only up to
# where the two diverge, and on sliding-window models (Gemma 3: 512-token window) only when
# they diverge within the window of the snapshot's end: a restore clears the server's context
# checkpoints and keeps only the window's cells of the sliding layers, so an earlier
# divergence re-prefills everything (measured, docs/DESIGN.md "Prefix first"). The server does
# not say its window; this is below the smallest common one.
PREFIX_TAIL_TOKENS = 384


@dataclass(frozen=True)
class Prefix:
    """A new conversation's parent: the session whose conversation shares the longest chain
    prefix with it, `items` chain items (the system block, then messages) of `chars`
    characters; `parent_chars`: the parent's whole prompt."""

    session: str
    items: int
    chars: int
    parent_chars: int


def prefix_restore_tokens(prefix: Prefix, *, snapshot_tokens: int,
                          snapshot_messages: int) -> int:
    """Tokens a new conversation may reuse from restoring its parent's snapshot (holding
    `snapshot_messages` messages), 0 when the restore would not pay. Tokens are estimated
    from the parent's own characters per token."""
    if snapshot_tokens <= 0 or prefix.items < 1 or prefix.parent_chars <= 0:
        return 0
    if snapshot_messages <= prefix.items - 1:
        return snapshot_tokens  # the snapshot is all prefix (its reply may differ)
    shared = min(snapshot_tokens, snapshot_tokens * prefix.chars // prefix.parent_chars)
    if snapshot_tokens - shared > PREFIX_TAIL_TOKENS:
        return 0
    return shared


def strictly_extends(chain: Sequence[str], conversation: Conversation | None) -> bool:
    """A request that holds the whole conversation and more: its client has read the answer
    of the request that made that conversation (the reply is in it)."""
    return (conversation is not None and bool(conversation.head)
            and len(chain) > conversation.length and extends(chain, conversation))


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
