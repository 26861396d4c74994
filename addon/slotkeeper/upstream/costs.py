"""What one llama-server (one model of it) costs, measured from its own answers (issue #31).

Running estimates, each an exponential moving average of the server's own figures:

- prefill tokens/s: `timings.prompt_n / prompt_ms` of answers that prefilled enough tokens;
- decode tokens/s: `timings.predicted_n / predicted_ms` of answers that generated enough;
- save and restore bytes/s: a slot call's `n_written` (`n_read`) over its `save_ms`
  (`restore_ms`), for calls that moved enough bytes to be more than the call's overhead;
- a slot file's size for n tokens, `fixed + n * per token`: a least-squares line through the
  last slot calls' (tokens, bytes). Not bytes over tokens: a file carries a fixed part (the
  sliding-window cells of an SWA model: 4.6 MiB of the test model's 5.8 MiB at 330 tokens,
  measured), so the ratio of a short session was 4.9 times the real cost of one more token.

A few tokens or bytes are dominated by per-call overhead, not by the rate being measured, so
they are not counted (the minimums below). Nothing here does I/O; the upstream client holds one
per server and every room that learns a figure reports it. Thread-safe."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, replace

from ..decisions.pricing import Rates

ALPHA = 0.2  # weight of the newest sample: the last ~10 samples dominate
MIN_PREFILL_TOKENS = 32
MIN_DECODE_TOKENS = 8
MIN_SLOT_BYTES = 1024 * 1024
SIZE_SAMPLES = 32  # (tokens, bytes) of the latest slot calls, for the size line


class Costs:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates = Rates()
        self._sizes: deque[tuple[int, float]] = deque(maxlen=SIZE_SAMPLES)

    def rates(self) -> Rates:
        return self._rates

    def answered(self, prompt_n: int, prompt_ms: float, predicted_n: int,
                 predicted_ms: float) -> None:
        """An answer's own timings."""
        prefill = _rate(prompt_n, prompt_ms / 1000, MIN_PREFILL_TOKENS)
        decode = _rate(predicted_n, predicted_ms / 1000, MIN_DECODE_TOKENS)
        if prefill is not None or decode is not None:
            self._update(prefill_tokens_per_s=prefill, decode_tokens_per_s=decode)

    def saved(self, nbytes: int, tokens: int, ms: float) -> None:
        """A save's `n_written`, `n_saved` and `save_ms`."""
        self._update(save_bytes_per_s=_rate(nbytes, ms / 1000, MIN_SLOT_BYTES))
        self._sized(nbytes, tokens)

    def restored(self, nbytes: int | float, tokens: int, ms: float) -> None:
        """A restore's `n_read`, `n_restored` and `restore_ms`."""
        self._update(restore_bytes_per_s=_rate(nbytes, ms / 1000, MIN_SLOT_BYTES))
        self._sized(nbytes, tokens)

    def _sized(self, nbytes: int | float, tokens: int) -> None:
        if not isinstance(nbytes, (int, float)) or not isinstance(tokens, int) or tokens <= 0:
            return
        with self._lock:
            self._sizes.append((tokens, float(nbytes)))
            per_token, fixed = size_line(self._sizes)
            self._rates = replace(self._rates, kv_bytes_per_token=per_token,
                                  slot_fixed_bytes=fixed)

    def _update(self, **samples: float | None) -> None:
        counted = {k: v for k, v in samples.items() if v is not None}
        if not counted:
            return
        with self._lock:
            now = asdict(self._rates)
            for key, sample in counted.items():
                old = now[key]
                now[key] = sample if old is None else old + ALPHA * (sample - old)
            now["samples"] += 1
            self._rates = Rates(**now)


def _rate(amount: int | float, seconds: float, minimum: int) -> float | None:
    if not isinstance(amount, (int, float)) or not isinstance(seconds, (int, float)):
        return None
    if amount < minimum or not 0 < seconds < float("inf"):
        return None
    return amount / seconds


def size_line(points: deque[tuple[int, float]] | list[tuple[int, float]]
              ) -> tuple[float | None, float | None]:
    """(bytes per token, fixed bytes) of the least-squares line through (tokens, bytes); with
    one token count only, bytes over tokens and no fixed part (an upper bound). (None, None)
    when the line does not rise (no cost of a token can be told yet)."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_b = sum(b for _, b in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return mean_b / mean_t, 0.0
    slope = sum((t - mean_t) * (b - mean_b) for t, b in points) / spread
    if slope <= 0:
        return None, None
    return slope, max(mean_b - slope * mean_t, 0.0)
