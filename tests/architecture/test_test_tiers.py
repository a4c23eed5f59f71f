"""The test tiers do not rot: a test that starts a process or a server, or compiles, carries the marker that says so.

`make test-fast` runs ``-m "not spawns and not server and not compiles"``; a test that starts processes without the
marker would slow that loop down unseen. This file reads every test module's source (``ast``, nothing is imported)
and, for each test, what it reaches inside its module: its own body, the module's functions it calls and the
module's fixtures it asks for, transitively. What starts processes, servers or compiles is recognised by name
(``TRIGGERS``); the marker may sit on the module (``pytestmark``), on the test's class or on the test.
Also here: the parser of tests/durations_by_file.py, on a made-up report.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from durations_by_file import durations_by_file, markdown_table, registered_markers, slowest_files_first

TESTS = Path(__file__).resolve().parents[1]

# Marker -> names whose use in a test (directly or through its module's functions and fixtures) means the test needs
# it. Attribute names count as well as bare names (``subprocess.run``, ``torch.compile``); fixtures count by their
# parameter name (``hub_server``, conftest.py's one server per module).
TRIGGERS = {
    "spawns": {
        "subprocess",
        "Popen",
        "multiprocessing",
        "start_processes",
        "spawn",
        "run_recipe",
        "launch_processes",
        "compile_kernels_for_gpu",
    },
    "server": {"hub_server", "HubServer", "free_port", "ThreadingHTTPServer", "HTTPServer"},
    "compiles": {"compile"},
}
# ``compile`` only as ``torch.compile``: Python's builtin ``compile`` and ``re.compile`` compile nothing slow.
COMPILE_OWNERS = {"torch"}


def marks_of(decorators: list[ast.expr]) -> set[str]:
    """Marker names applied by ``@pytest.mark.NAME`` / ``@pytest.mark.NAME(...)`` decorators (or a list of them)."""
    names = set()
    for node in decorators:
        for part in ast.walk(node):
            if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Attribute) and part.value.attr == "mark":
                names.add(part.attr)
    return names


def used_triggers(function: ast.AST) -> set[str]:
    """The markers that ``function``'s own body and parameters call for (see TRIGGERS)."""
    found = set()
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            if node.attr == "compile":
                if isinstance(node.value, ast.Name) and node.value.id in COMPILE_OWNERS:
                    found.add("compiles")
            else:
                names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.name.split(".")[0] for alias in node.names)
    for marker, triggers in TRIGGERS.items():
        if marker != "compiles" and names & triggers:
            found.add(marker)
    return found


def referenced_names(function: ast.AST) -> set[str]:
    """Bare names and parameter names in ``function``: the module functions it calls and the fixtures it asks for."""
    names = {node.id for node in ast.walk(function) if isinstance(node, ast.Name)}
    names |= {node.arg for node in ast.walk(function) if isinstance(node, ast.arg)}
    return names


def unmarked_tests(path: Path) -> list[str]:
    """``"file::test needs @pytest.mark.X"`` for each test of the module at ``path`` that lacks a marker it needs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module_marks = set()
    functions: dict[str, ast.AST] = {}
    tests: list[tuple[str, ast.AST, set[str]]] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets
        ):
            module_marks |= marks_of([node.value])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = node
            if node.name.startswith("test"):
                tests.append((node.name, node, marks_of(node.decorator_list)))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            class_marks = marks_of(node.decorator_list)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    tests.append((f"{node.name}::{item.name}", item, class_marks | marks_of(item.decorator_list)))

    def reached_triggers(function: ast.AST, seen: set[str]) -> set[str]:
        found = used_triggers(function)
        for name in referenced_names(function) - seen:
            if name in functions:
                seen.add(name)
                found |= reached_triggers(functions[name], seen)
        return found

    shown = path.relative_to(TESTS) if path.is_relative_to(TESTS) else path.name
    missing = []
    for name, function, marks in tests:
        for marker in sorted(reached_triggers(function, {name}) - marks - module_marks):
            missing.append(f"{shown}::{name} needs @pytest.mark.{marker}")
    return missing


def test_every_test_that_starts_processes_servers_or_compiles_carries_its_marker():
    missing = [line for path in sorted(TESTS.rglob("test_*.py")) for line in unmarked_tests(path)]
    assert not missing, (
        "these tests start processes or servers, or compile, without the marker that keeps them out of "
        "`make test-fast`; add it to the test (or `pytestmark = pytest.mark.NAME` for the whole module):\n"
        + "\n".join(missing)
    )


def test_the_tier_markers_are_registered():
    assert set(TRIGGERS) <= set(registered_markers()), "register the tier markers in pyproject.toml's pytest markers"


def test_the_guard_sees_a_subprocess_reached_through_a_fixture_and_a_helper(tmp_path):
    module = tmp_path / "test_made_up.py"
    module.write_text(
        "import subprocess, pytest, torch\n"
        "def _run():\n    return subprocess.run(['true'])\n"
        "@pytest.fixture\ndef ran():\n    return _run()\n"
        "def test_unmarked(ran):\n    pass\n"
        "@pytest.mark.spawns\ndef test_marked(ran):\n    pass\n"
        "def test_compiled():\n    torch.compile(lambda x: x)\n"
        "def test_regex():\n    import re\n    re.compile('x')\n"
        "def test_served(hub_server):\n    pass\n"
    )
    missing = [line.split("::", 1)[1] for line in unmarked_tests(module)]
    assert missing == [
        "test_unmarked needs @pytest.mark.spawns",
        "test_compiled needs @pytest.mark.compiles",
        "test_served needs @pytest.mark.server",
    ]


MADE_UP_REPORT = """\
....                                                                     [100%]
============================== slowest durations ===============================
12.50s call     tests/test_slow.py::test_a[x-1]
1.25s setup    tests/test_slow.py::test_a[x-1]
0.25s teardown tests/test_slow.py::test_a[x-1]
2.00s call     tests/test_slow.py::test_b
0.10s call     tests/test_fast.py::test_c
0.00s setup    tests/test_fast.py::test_d
4 passed in 16.10s
"""


def test_durations_are_summed_by_file_and_tests_counted_once():
    files = durations_by_file(MADE_UP_REPORT)
    assert {path: (round(spent.seconds, 2), len(spent.tests)) for path, spent in files.items()} == {
        "tests/test_slow.py": (16.0, 2),
        "tests/test_fast.py": (0.1, 2),
    }
    table = markdown_table(files, {"tests/test_slow.py": ["spawns"]}).splitlines()
    assert table[2] == "| `tests/test_slow.py` | 16.0 | 2 | spawns |"
    assert table[3] == "| `tests/test_fast.py` | 0.1 | 2 |  |"
    assert table[-1] == "| total | 16.1 | 4 | |"


@pytest.mark.parametrize("line", ["1526 passed, 30 skipped in 1023.16s (0:17:03)", "0.11s call     no node id"])
def test_lines_that_are_not_durations_are_ignored(line):
    assert durations_by_file(line) == {}


class MadeUpItem:
    """What slowest_files_first reads of a pytest item: its file's path."""

    def __init__(self, path: str, name: str):
        self.path, self.name = Path(path), name


def test_files_are_handed_out_slowest_first_with_unknown_files_in_front_and_each_file_in_its_order():
    items = [
        MadeUpItem("tests/test_fast.py", "a"),
        MadeUpItem("tests/test_fast.py", "b"),
        MadeUpItem("tests/ops/test_slow.py", "c"),  # known by file name, wherever the file sits
        MadeUpItem("tests/test_new.py", "d"),
        MadeUpItem("tests/test_slow.py", "e"),  # another file of the same name: after the first, as collected
        MadeUpItem("tests/test_fast.py", "f"),
    ]
    ordered = slowest_files_first(items, {"test_slow.py": 30.0, "test_fast.py": 1.5})
    assert [item.name for item in ordered] == ["d", "c", "e", "a", "b", "f"]
