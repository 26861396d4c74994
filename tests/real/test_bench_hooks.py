"""scripts/bench-hooks runs: both addon versions take the fast path (`kept`) in their
measured requests, each hook is timed, and a folder without the addon is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench-hooks"


def test_bench_hooks_measures_kept_requests_of_both_versions(llama_bin, model_path, tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--before", str(REPO / "addon"), "--requests", "20",
         "--reps", "1", "--rounds", "1", "--hooks", "--name", "t", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "t.json").read_text())
    for name in ("now", "before"):
        assert data["runs"][name][0]["action"] == "kept"
        assert data["summary"][name]["median_us"] > 0
        hooks = data["summary"][name]["hook_us"]
        assert hooks["SlotKeeper.on_request"] > 0 and hooks["Front.request"] > 0
        assert hooks["BrowserGuard.requestheaders"] > 0


def test_bench_hooks_measures_a_real_clients_request_kept(llama_bin, model_path, tmp_path):
    """--corpus: a recorded client request (pi's: its route, session headers and body) is the
    measured one, and it is kept like the synthetic one."""
    corpus = REPO / "tests" / "bed" / "corpus" / "pi" / "pi-02-next-main.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--corpus", str(corpus), "--requests", "20", "--reps",
         "1", "--rounds", "1", "--name", "c", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["runs"]["now"][0]["action"] == "kept"
    assert data["args"]["corpus"] == str(corpus)


def test_bench_hooks_refuses_a_missing_corpus_file(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--corpus", str(tmp_path / "no.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no such file" in done.stderr


def test_bench_hooks_refuses_a_folder_without_the_addon(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--before", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no slotkeeper/addon.py" in done.stderr
