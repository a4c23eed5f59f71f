"""Turn pytest's ``--durations=0`` report into the per-file table of docs/testing.md.

Usage (from the repository root)::

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 --durations-min=0 | tee durations.log
    .venv/bin/python tests/durations_by_file.py durations.log

``--durations-min=0`` keeps the tests under pytest's default 5 ms floor in the report, so every test that ran is
counted (a log without it undercounts the fast files' tests; their seconds barely change). Each file's seconds are
the sum of its tests' setup, call and teardown: CPU-bound work on one worker, so with ``--dist loadfile`` the wall
time of the run is at least the largest file and at least the total over the worker count. The marker column names
the tier markers (pyproject.toml's ``[tool.pytest.ini_options] markers``) that the file's text applies.

``--json tests/file_seconds.json`` also writes each file's seconds by file name: conftest.py hands the files to the
pytest-xdist workers slowest first (``slowest_files_first``), so that no long file starts last and runs alone while
the other worker has finished (xdist's own order, the most tests first, put the few-test process-starting files last).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FILE_SECONDS = Path(__file__).resolve().parent / "file_seconds.json"

# One line of pytest's durations report: "12.34s call     tests/test_x.py::test_y[param]".
DURATION_LINE = re.compile(r"^\s*(?P<seconds>\d+(?:\.\d+)?)s\s+(?P<phase>setup|call|teardown)\s+(?P<nodeid>\S.*?)\s*$")


@dataclass
class FileDurations:
    """What one test file spent: seconds over setup + call + teardown, and the distinct tests reported."""

    seconds: float = 0.0
    tests: set[str] = field(default_factory=set)


def durations_by_file(report: str) -> dict[str, FileDurations]:
    """Sum a ``--durations=0`` report by file.

    ``report`` is pytest's whole output (lines that are not durations are ignored); a test id is the part of the
    node id before ``::``. Returns ``{path: FileDurations}`` in the report's order of first appearance.
    """
    files: dict[str, FileDurations] = defaultdict(FileDurations)
    for line in report.splitlines():
        match = DURATION_LINE.match(line)
        if match is None or "::" not in match["nodeid"]:
            continue
        nodeid = match["nodeid"]
        path = nodeid.split("::", 1)[0]
        files[path].seconds += float(match["seconds"])
        files[path].tests.add(nodeid)
    return dict(files)


def registered_markers(pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[str]:
    """The marker names registered in pyproject.toml's ``[tool.pytest.ini_options] markers``."""
    import tomllib

    options = tomllib.loads(pyproject.read_text())["tool"]["pytest"]["ini_options"]
    return [entry.split(":", 1)[0].strip() for entry in options.get("markers", [])]


def markers_in(path: Path, names: list[str]) -> list[str]:
    """The marker names among ``names`` that the file's text applies (``pytest.mark.NAME``), in ``names`` order."""
    if not path.exists():
        return []
    text = path.read_text()
    return [name for name in names if re.search(rf"\bmark\.{re.escape(name)}\b", text)]


def markdown_table(files: dict[str, FileDurations], markers: dict[str, list[str]] | None = None) -> str:
    """A Markdown table (file, seconds, tests, markers), slowest file first, with a total row."""
    markers = markers or {}
    rows = ["| file | seconds | tests | markers |", "|---|---:|---:|---|"]
    for path, spent in sorted(files.items(), key=lambda item: (-item[1].seconds, item[0])):
        rows.append(f"| `{path}` | {spent.seconds:.1f} | {len(spent.tests)} | {', '.join(markers.get(path, []))} |")
    total_seconds = sum(spent.seconds for spent in files.values())
    total_tests = sum(len(spent.tests) for spent in files.values())
    rows.append(f"| total | {total_seconds:.1f} | {total_tests} | |")
    return "\n".join(rows)


def slowest_files_first(items: list, seconds: dict[str, float]) -> list:
    """``items`` (pytest items) reordered file by file, the file with the most ``seconds`` first (by file name, so the
    table survives a file's move to another folder); a file the table does not know yet comes first, as if slow. The
    order within a file, and between files of equal seconds, is kept."""
    order = {}
    for item in items:
        order.setdefault(item.path, len(order))
    return sorted(items, key=lambda item: (-seconds.get(item.path.name, math.inf), order[item.path]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="pytest output of a run with --durations=0 (- for stdin)")
    parser.add_argument("--json", type=Path, help="also write {file name: seconds} there (tests/file_seconds.json)")
    args = parser.parse_args(argv)
    report = sys.stdin.read() if str(args.log) == "-" else args.log.read_text()
    files = durations_by_file(report)
    if not files:
        raise SystemExit(f"{args.log}: no durations found; run pytest with --durations=0 --durations-min=0")
    names = registered_markers()
    print(markdown_table(files, {path: markers_in(REPO_ROOT / path, names) for path in files}))
    if args.json:
        by_name = {Path(path).name: round(spent.seconds, 1) for path, spent in files.items()}
        args.json.write_text(json.dumps(dict(sorted(by_name.items(), key=lambda item: -item[1])), indent=0) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
