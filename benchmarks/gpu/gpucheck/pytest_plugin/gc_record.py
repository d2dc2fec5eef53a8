"""gc_record: a pytest plugin that writes each test's outcome as it happens.

The check's test stages load it with `-p gc_record` (this folder on PYTHONPATH
for those stages only). pytest names its failures (-rfE) only at its end, which
a stage cut at its limit never reaches; this record, written line by line,
still says what finished and how.

$GC_RECORD gets one line per outcome, KIND<TAB>NODEID<TAB>WHEN, KIND one of
passed, failed, error, skipped, xfailed, xpassed, and first a line
`collected<TAB>N<TAB>`. $GC_RECORD.reports gets each failure's report (its
last 25 lines). Without GC_RECORD the plugin does nothing. Under pytest-xdist
the controller writes (the workers' reports reach it), never the workers.
Standard library and pytest only: it runs in whatever Python the tests do.
"""
import os

import pytest

_out = _reports = None
_collected = False


def pytest_configure(config):
    global _out, _reports
    path = os.environ.get("GC_RECORD")
    if path and not hasattr(config, "workerinput"):  # not in an xdist worker
        # line-buffered: a run killed at its limit keeps every line written
        _out = open(path, "a", buffering=1)
        _reports = open(path + ".reports", "a", buffering=1)


def _collection(n):
    global _collected
    if _out is not None and not _collected:
        _collected = True
        _out.write(f"collected\t{n}\t\n")


def pytest_collection_finish(session):  # without xdist
    _collection(len(session.items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):  # xdist: every worker collects the same
    _collection(len(ids))


def outcome(report):
    """The record's KIND for a report, or None where it adds nothing (a passing setup or teardown)."""
    xfail = hasattr(report, "wasxfail")
    if report.when not in ("setup", "teardown"):  # the call, or xdist's report of a crashed worker
        if report.passed:
            return "xpassed" if xfail else "passed"
        if report.skipped:
            return "xfailed" if xfail else "skipped"
        return "failed"
    if report.failed:
        return "error"
    if report.skipped and report.when == "setup":  # a skip mark, or a skip in a fixture
        return "xfailed" if xfail else "skipped"
    return None


def pytest_runtest_logreport(report):
    if _out is None:
        return
    kind = outcome(report)
    if kind is None:
        return
    _out.write(f"{kind}\t{report.nodeid}\t{report.when}\n")
    if kind in ("failed", "error"):
        text = (report.longreprtext or "").splitlines()
        cut = f"; its last 25 of {len(text)} lines" if len(text) > 25 else ""
        _reports.write(f"----- {kind.upper()} {report.nodeid} (at {report.when}{cut})\n")
        _reports.write("\n".join(text[-25:]) + "\n")
