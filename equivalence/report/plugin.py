"""`pytest --equivalence-report DIR`: when an equivalence test fails, write the equivalence report there.

The report (equivalence/report/divergence.py) runs the config of `--equivalence-report-config` (default the
single-process
fp32 fixture config) once per session, into DIR/<config name>/report.json and report.html, and the terminal
summary names the first diverging checkpoint beside the failed tests. A report that cannot be made is named
there too; it never changes a test's outcome.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "tiny_single.yaml"
_WRITTEN: dict[str, str] = {}  # config -> summary line (or why no report)
_FAILED: list[str] = []


def pytest_addoption(parser):
    group = parser.getgroup("equivalence report")
    group.addoption(
        "--equivalence-report",
        metavar="DIR",
        help="on an equivalence test failure, write the first-diverging-layer report (JSON + HTML) here",
    )
    group.addoption(
        "--equivalence-report-config",
        metavar="YAML",
        default=str(DEFAULT_CONFIG),
        help="the inference config the report runs (world_size 1; default %(default)s)",
    )


def write_failure_report(out_dir: str | Path, config: str | Path) -> str:
    """The report of `config` into out_dir/<config stem>/ (once per config and session): its summary line."""
    key = str(config)
    if key not in _WRITTEN:
        from equivalence.report.divergence import ReportError, report_for_config, write_report

        try:
            report = report_for_config(config)
            json_path, html_path = write_report(report, Path(out_dir) / Path(config).stem)
            _WRITTEN[key] = f"{report.summary()} ({json_path}, {html_path})"
        except (ReportError, OSError) as e:
            _WRITTEN[key] = f"no report for {config}: {e}"
    return _WRITTEN[key]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    out_dir = item.config.getoption("equivalence_report", None)
    if out_dir and report.when == "call" and report.failed and item.get_closest_marker("equivalence"):
        _FAILED.append(item.nodeid)
        line = write_failure_report(out_dir, item.config.getoption("equivalence_report_config"))
        report.sections.append(("equivalence report", line))


def pytest_terminal_summary(terminalreporter):
    if _WRITTEN:
        terminalreporter.section("equivalence report")
        terminalreporter.write_line(f"{len(_FAILED)} failed equivalence test(s): {', '.join(_FAILED)}")
        for line in _WRITTEN.values():
            terminalreporter.write_line(line)
