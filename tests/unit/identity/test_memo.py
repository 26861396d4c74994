"""The bounded memory identify keeps of what every turn sends again (memo.py)."""

from __future__ import annotations

import threading

from slotkeeper.identity.memo import Memo


def test_a_value_is_made_once_and_found_after():
    made: list[str] = []
    memo: Memo[str, str] = Memo(4)

    def make(key: str) -> str:
        made.append(key)
        return key.upper()

    assert [memo.get(k, lambda k=k: make(k)) for k in ("a", "b", "a", "a")] == ["A", "B", "A", "A"]
    assert made == ["a", "b"]


def test_the_least_recently_used_is_forgotten_first():
    memo: Memo[int, int] = Memo(2)
    made: list[int] = []

    def get(key: int) -> int:
        return memo.get(key, lambda: made.append(key) or key)

    get(1), get(2), get(1), get(3)  # 2 is the least recently used
    assert len(memo) == 2
    get(1), get(2)
    assert made == [1, 2, 3, 2]


def test_threads_share_it_without_losing_its_bound():
    memo: Memo[int, int] = Memo(16)
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(2000):
                key = (i + offset) % 40
                assert memo.get(key, lambda key=key: key * 2) == key * 2
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(memo) == 16
