"""`slotkeeper status`'s rendering of what the proxy reports, without processes (the real runs
are in tests/real/test_status_real.py)."""

from __future__ import annotations

from slotkeeper.launcher.status import Report, measured_costs, render


def test_measured_costs_in_one_line():
    line = measured_costs({"prefill_tokens_per_s": 152.4, "decode_tokens_per_s": 41.0,
                           "save_bytes_per_s": 2.5 * (1 << 30), "restore_bytes_per_s": None,
                           "kv_bytes_per_token": 3754.4, "slot_fixed_bytes": 4_853_374.0,
                           "samples": 7})
    assert line == ("  Measured: prefill 152 tokens/s, decode 41 tokens/s, save 2.5 GiB/s, "
                    "KV 3.7 KiB/token, plus 4.6 MiB a file")
    assert measured_costs({"samples": 0}) == "  Measured: nothing yet"
    assert measured_costs({"kv_bytes_per_token": 18_460.0, "slot_fixed_bytes": 0.0}) == (
        "  Measured: KV 18.0 KiB/token")


def test_an_upstream_shows_its_measured_costs_under_its_slots():
    report = Report("proxy", "http://127.0.0.1:8000", slot_dir=None)
    report.sessions = []
    report.upstreams = [{"url": "http://127.0.0.1:8080", "model": None, "reachable": None,
                         "error": None, "slot_count": None, "owned": 0, "slots": [],
                         "costs": {"prefill_tokens_per_s": 150.0}}]
    text = render(report)
    assert "Upstream http://127.0.0.1:8080: 0 owned, not checked" in text
    assert "  Measured: prefill 150 tokens/s" in text
