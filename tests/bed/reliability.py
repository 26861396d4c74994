"""The reliability table (docs/RELIABILITY.md) is produced from the test run: the tests that try a
fault or a bad input record what happened through the `reliability` fixture, this plugin adds
each test's result and writes every row to build/reliability.json when the run ends, and
`scripts/reliability-table` renders the table from that file.

A test module uses it with `from reliability import reliability  # noqa: F401` (pytest finds
fixtures imported into a test module), then in a test:

    reliability.row("llama-server killed mid-stream", outcome="...", lost="none")

Rows of tests that did not run this time (deselected with -k or -m) are kept from the previous
file, so a partial run updates only its own rows. The plugin registers itself the first time a
test asks for the fixture, so the project's conftest.py needs no change.

Also here: checks every hardening test makes of a process log."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("SLOTKEEPER_RELIABILITY_JSON") or REPO / "build" / "reliability.json")

AREAS = (
    "llama-server faults",
    "slot folder and files",
    "proxy faults",
    "concurrency",
    "hostile input",
    "management access",
    "attacks",
    "properties",
)


@dataclass
class Row:
    area: str
    case: str
    outcome: str
    lost: str
    test: str
    result: str = "not finished"
    run: str = ""


@dataclass
class _Plugin:
    rows: dict[str, list[Row]] = field(default_factory=dict)
    results: dict[str, str] = field(default_factory=dict)
    areas: dict[str, str] = field(default_factory=dict)
    started: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).strftime(
        "%Y-%m-%d %H:%M UTC"))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self.rows:
            return
        if report.failed:
            self.results[report.nodeid] = "failed"
        elif report.when == "call" and report.passed:
            self.results.setdefault(report.nodeid, "passed")
        elif report.skipped:
            self.results[report.nodeid] = "skipped"

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.write()

    def write(self) -> None:
        old = load(RESULTS)
        old_rows = [r for r in old.get("rows", []) if isinstance(r, dict)]
        ran = set(self.rows)
        kept = [r for r in old_rows if r.get("test") not in ran]
        new = []
        for nodeid, rows in self.rows.items():
            result = self.results.get(nodeid, "not finished")
            if not rows:
                # It failed before recording anything: its rows from the last run stay, marked
                # with this run's result, so a failure never drops a row from the table.
                rows = [Row(**{k: r.get(k, "") for k in ("area", "case", "outcome", "lost")},
                            test=nodeid) for r in old_rows if r.get("test") == nodeid]
                if not rows:
                    rows = [Row(area=self.areas.get(nodeid, AREAS[0]), case=nodeid.split("::")[-1],
                                outcome="(no row recorded)", lost="unknown", test=nodeid)]
            for row in rows:
                row.result = result
                row.run = self.started
                new.append(asdict(row))
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        doc = {"written": self.started, "commit": _commit(), "rows": kept + new}
        tmp = RESULTS.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        tmp.replace(RESULTS)


def load(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
    except OSError:
        return ""
    return out.stdout.strip()


_PLUGIN_NAME = "slotkeeper-reliability"


def _plugin(config: pytest.Config) -> _Plugin:
    plugin = config.pluginmanager.get_plugin(_PLUGIN_NAME)
    if plugin is None:
        plugin = _Plugin()
        config.pluginmanager.register(plugin, _PLUGIN_NAME)
    return plugin


class Recorder:
    def __init__(self, plugin: _Plugin, nodeid: str, area: str) -> None:
        self._plugin = plugin
        self._nodeid = nodeid
        self.area = area

    def row(self, case: str, *, outcome: str, lost: str = "none", area: str | None = None
            ) -> None:
        """One fault or input tried and what happened. Call it after the assertions that
        prove the outcome, so a row is only written for what was checked."""
        area = area or self.area
        assert area in AREAS, area
        rows = self._plugin.rows.setdefault(self._nodeid, [])
        if any(r.area == area and r.case == case for r in rows):
            return  # a property test runs its body once per example: one row is enough
        rows.append(Row(area=area, case=case, outcome=outcome, lost=lost, test=self._nodeid))


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Iterator[Recorder]:
    """Record rows of the reliability table. The area defaults to the module's
    RELIABILITY_AREA."""
    plugin = _plugin(request.config)
    area = getattr(request.module, "RELIABILITY_AREA", "hostile input")
    plugin.rows.setdefault(request.node.nodeid, [])
    plugin.areas[request.node.nodeid] = area
    yield Recorder(plugin, request.node.nodeid, area)


# ---- log checks --------------------------------------------------------------------------------

TRACEBACK = re.compile(r"Traceback \(most recent call last\)|Addon error|GGML_ASSERT|"
                       r"Segmentation fault|core dumped")


def problems_in(log: str) -> list[str]:
    """Lines of a mitmdump or llama-server log that show a crash or an unhandled exception."""
    return [line for line in log.splitlines() if TRACEBACK.search(line)]
