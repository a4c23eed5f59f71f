"""The import graph of the library and the recipes, read from the source with ``ast`` (nothing is imported), and
where the scorers' names may appear (the names come from the scorer registry itself).

Every ``import`` counts, at module level or inside a function: a function-level import is an edge that only
shows up late, and a circle through one is still a circle. docs/api.md ("How the code is laid out") describes
the floors checked here. One edge the source does not show, a package's ``__init__`` run before any module inside
it, is checked by importing the low floors in a fresh interpreter.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import pytest

from hf_neural_attn.scorers import SCORERS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hf_neural_attn", "recipes")

# The library's floors, lowest first: a module may import modules of its own floor and of the floors below it.
# Within a floor, the import graph must still have no circle (checked separately). Patterns are module names;
# a trailing ".*" covers a package and everything under it.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    (
        "leaves",
        (
            "hf_neural_attn._version",
            "hf_neural_attn._warnings",
            # What the library reads of other libraries: the version floor, the accessors of their private names,
            # DTensor recognised, the attention registries' names.
            "hf_neural_attn.compat",
            "hf_neural_attn.compat.*",
            # The faces of the packages: they import nothing at their top, so that importing any floor inside them
            # runs nothing else (checked in a fresh interpreter below).
            "hf_neural_attn.ops",
            "hf_neural_attn.parallel",
            "hf_neural_attn.integrations",
        ),
    ),
    ("fused-term contract", ("hf_neural_attn.ops.terms",)),
    ("compute choices", ("hf_neural_attn.ops.choices",)),
    ("kernels", ("hf_neural_attn.ops.triton", "hf_neural_attn.ops.triton.*")),
    # The paths and what they share: masks, dropout, grouped products, a call split into its sequences.
    ("compute paths", ("hf_neural_attn.ops.*",)),
    ("math", ("hf_neural_attn.scorers", "hf_neural_attn.scorers.*")),
    # Resolving the impl choice for a scorer's call and calling a path: above the scorers, which never import it.
    ("dispatch", ("hf_neural_attn.ops.dispatch",)),
    # Where and how weights are held (offloaded, ZeRO-3 partitioned, quantized): every family reads its weights
    # through it, so it sits just below them.
    ("weight placement", ("hf_neural_attn.placement", "hf_neural_attn.placement.*")),
    # Parallelism shards the scorers (tensor), finds torch's context-parallel block and refuses Ulysses: beside the
    # families.
    (
        "model plumbing",
        (
            "hf_neural_attn.families",
            "hf_neural_attn.families.*",
            "hf_neural_attn.parallel.*",
            "hf_neural_attn.narrow_keys",
        ),
    ),
    # PLACEMENTS, the ways weights are held, and the phases the patch calls them through: above each of them.
    ("placements", ("hf_neural_attn.placements",)),
    ("record", ("hf_neural_attn.record",)),
    ("config", ("hf_neural_attn.model_cards", "hf_neural_attn.patched_config")),
    ("attention", ("hf_neural_attn.attention", "hf_neural_attn.paged_attention")),
    ("patch plan", ("hf_neural_attn.patch_plan",)),
    ("patching", ("hf_neural_attn.patching",)),
    ("loading", ("hf_neural_attn.loading", "hf_neural_attn.loading.*")),
    (
        "extras",
        (
            "hf_neural_attn.peft_utils",
            "hf_neural_attn.plotting",
            "hf_neural_attn.auto",
        ),
    ),
    # What the library installs in other libraries (the table, the wrappers) and what they load from the outside
    # (a vLLM plugin): it stands on the library.
    ("integrations", ("hf_neural_attn.integrations.*",)),
    ("package", ("hf_neural_attn",)),
    ("commands", ("hf_neural_attn.serve",)),
]

# What the recipes may import from the library: docs/api.md's public modules.
PUBLIC_MODULES = ("hf_neural_attn", "hf_neural_attn.scorers", "hf_neural_attn.plotting")


def module_files() -> dict[str, Path]:
    """Module name -> source file, for every module of the library and the recipes."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imports_of(name: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in module ``name``, function-level ones
    included. ``from package import name`` is an import of the submodule ``package.name`` when there is one."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    package = name if is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, None, node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
    return found


def internal_graph() -> dict[str, set[str]]:
    """Module -> the library and recipe modules it imports (the nearest known module of each import)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for target, _, _ in imports_of(name):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module are circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def floor_of(name: str) -> int | None:
    """The floor of module ``name``: the one that names it, else the one whose package pattern (``.*``) covers it
    most narrowly (``ops.triton.*`` before ``ops.*``); None where none does."""
    for level, (_, patterns) in enumerate(FLOORS):
        if name in patterns:
            return level
    covering = [
        (len(pattern), level)
        for level, (_, patterns) in enumerate(FLOORS)
        for pattern in patterns
        if pattern.endswith(".*") and name.startswith(pattern[:-1])
    ]
    return max(covering)[1] if covering else None


def test_the_checker_finds_a_circle_and_resolves_relative_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c for c in strongly_connected_components(graph) if len(c) > 1] == [["a", "b", "c"]]
    # from .families import FAMILIES (a name) -> the families package; from . import pair_mlp -> the submodule.
    assert "hf_neural_attn.families" in internal_graph()["hf_neural_attn.attention"]
    assert "hf_neural_attn.ops.triton.pair_mlp" in internal_graph()["hf_neural_attn.ops.triton.common"]
    # The most narrowly covering pattern wins, and a module named on its own floor is there.
    assert FLOORS[floor_of("hf_neural_attn.ops.triton.fused")][0] == "kernels"
    assert FLOORS[floor_of("hf_neural_attn.ops.dispatch")][0] == "dispatch"


def test_the_import_graph_has_no_circle():
    circles = [c for c in strongly_connected_components(internal_graph()) if len(c) > 1]
    assert circles == [], f"import circles (function-level imports count): {circles}"


def test_every_library_module_has_a_floor():
    library = [name for name in MODULES if name.startswith("hf_neural_attn")]
    assert [name for name in library if floor_of(name) is None] == []


def test_library_modules_import_only_their_floor_and_below():
    graph = internal_graph()
    upward = []
    for name, targets in graph.items():
        if not name.startswith("hf_neural_attn"):
            continue
        for target in targets:
            if target.startswith("hf_neural_attn") and floor_of(target) > floor_of(name):
                upward.append(f"{name} ({FLOORS[floor_of(name)][0]}) imports {target} ({FLOORS[floor_of(target)][0]})")
    assert upward == []


def test_the_scorers_do_not_import_the_dispatcher():
    """How a model computes (``impl``) is a run-time setting the dispatcher reads, not scorer math: the scorers read
    the compute choices' names (``ops.choices``), the fused-term contract and the grouped products, never
    ``hf_neural_attn.ops.dispatch`` (nor the package's face)."""
    graph = internal_graph()
    scorers = [name for name in graph if floor_of(name) == floor_of("hf_neural_attn.scorers")]
    dispatcher = {"hf_neural_attn.ops", "hf_neural_attn.ops.dispatch"}
    assert scorers and [name for name in scorers if graph[name] & dispatcher] == []


def folder_of(name: str) -> str:
    """The folder of library module ``name`` as a reader sees the tree: the package directly under ``hf_neural_attn``
    that holds it (``ops/`` for ``hf_neural_attn.ops.triton.fused``), else the module itself (``patching``)."""
    parts = name.split(".")
    if len(parts) == 1:
        return name
    top = ".".join(parts[:2])
    return f"{parts[1]}/" if is_package(top) else parts[1]


def folder_graph() -> dict[str, set[str]]:
    """Folder -> the folders its modules import (the library only, a folder's imports of itself left out)."""
    graph: dict[str, set[str]] = {}
    for name, targets in internal_graph().items():
        if not name.startswith("hf_neural_attn"):
            continue
        graph.setdefault(folder_of(name), set())
        for target in targets:
            if target.startswith("hf_neural_attn") and folder_of(target) != folder_of(name):
                graph[folder_of(name)].add(folder_of(target))
                graph.setdefault(folder_of(target), set())
    return graph


def test_the_folder_reader_groups_modules_as_the_tree_does():
    assert folder_of("hf_neural_attn.ops.triton.fused") == folder_of("hf_neural_attn.ops") == "ops/"
    assert folder_of("hf_neural_attn.compat.internals") == "compat/"
    assert folder_of("hf_neural_attn.patching") == "patching"


def test_folders_import_one_way():
    """The folders are floors too: no folder imports a folder that imports it back, through any chain (a leaf that
    sat in the integrations folder, which also imports the whole library, made every floor import up into it)."""
    assert [sorted(circle) for circle in strongly_connected_components(folder_graph()) if len(circle) > 1] == []


# The modules of the patch: they reach the ways weights are held through the placement seam alone.
PATCH_MODULES = ("hf_neural_attn.patch_plan", "hf_neural_attn.patching", "hf_neural_attn.attention")
PLACEMENT_MODULES = ("hf_neural_attn.placement.", "hf_neural_attn.parallel.tensor")


def test_the_patch_names_no_placement():
    """``patch_plan.py``, ``patching.py`` and ``attention.py`` call offloading, ZeRO-3, quantized bases and tensor
    parallelism through ``hf_neural_attn.placements`` (each phase of every placement in turn), never by name."""
    graph = internal_graph()
    named = {name: sorted(t for t in graph[name] if t.startswith(PLACEMENT_MODULES)) for name in PATCH_MODULES}
    assert named == {name: [] for name in PATCH_MODULES}


def test_every_placement_is_in_the_list():
    """A ``Placement`` subclass defined anywhere in the library is one entry of ``PLACEMENTS``, under its own name."""
    from hf_neural_attn.placement.base import Placement
    from hf_neural_attn.placements import PLACEMENTS

    defined = {
        value
        for name in MODULES
        if name.startswith("hf_neural_attn.") and name != "hf_neural_attn.placement.base"
        and "Placement" in MODULES[name].read_text()
        for value in vars(importlib.import_module(name)).values()
        if isinstance(value, type) and issubclass(value, Placement) and value.__module__ == name
    }  # fmt: skip
    assert sorted(type(placement).__name__ for placement in PLACEMENTS) == sorted(cls.__name__ for cls in defined)
    assert len({placement.name for placement in PLACEMENTS}) == len(PLACEMENTS)


# Python runs a package's __init__ before any module inside it, an edge the graph above does not show. These modules,
# lowest floor first, are imported one after another in a fresh interpreter; its root package is a bare stand-in,
# since the real one imports the scorers and the installer on purpose.
LOW_FLOORS = (
    "hf_neural_attn.compat.internals",
    "hf_neural_attn.ops.terms",
    "hf_neural_attn.ops.choices",
    "hf_neural_attn.ops.triton",
    "hf_neural_attn.scorers",
)

LOADED_MODULES_SCRIPT = """
import json, sys, types
if sys.argv[1] != "-":
    root = types.ModuleType("hf_neural_attn")
    root.__path__ = [sys.argv[1]]
    sys.modules["hf_neural_attn"] = root
loaded = {}
for name in sys.argv[2:]:
    __import__(name)
    loaded[name] = sorted(module for module in sys.modules if module.startswith("hf_neural_attn."))
print(json.dumps(loaded))
"""


def modules_loaded_by(names: Iterable[str], *, stand_in_root: bool) -> dict[str, list[str]]:
    """Import ``names`` one after another in a fresh interpreter: after each, the library modules it has loaded."""
    root = str(ROOT / "hf_neural_attn") if stand_in_root else "-"
    finished = subprocess.run(
        [sys.executable, "-c", LOADED_MODULES_SCRIPT, root, *names],
        capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(finished.stdout.strip().splitlines()[-1])


@pytest.mark.spawns
def test_importing_a_low_floor_loads_only_that_floor_and_below():
    """``import hf_neural_attn.ops.choices`` (as the scorer configs do) runs the compute package's face first, which
    must not pull in the dispatcher, the paths or the kernels; nor may the kernels or the scorers."""
    loaded = modules_loaded_by(LOW_FLOORS, stand_in_root=True)
    above = {
        name: [module for module in modules if floor_of(module) > floor_of(name)] for name, modules in loaded.items()
    }
    assert above == {name: [] for name in LOW_FLOORS}
    assert "hf_neural_attn.ops.dispatch" not in loaded["hf_neural_attn.scorers"]


@pytest.mark.spawns
def test_importing_the_library_loads_no_compute_path():
    """``import hf_neural_attn`` (config classes, the record, the installer) loads the scorers' low floors only: the
    dispatcher, the paths (their torch operators registered at import) and the kernels wait for the first model."""
    (loaded,) = modules_loaded_by(["hf_neural_attn"], stand_in_root=False).values()
    compute = ("dispatch", "reference", "chunked", "blockwise", "triton", "sequences", "packed")
    assert [module for module in loaded if module.split(".")[2:3] in ([part] for part in compute)] == []


def test_only_the_record_module_touches_the_saved_record():
    """The record's saved form (a config's ``hf_neural_attn`` attribute, config.json's field) is read and written in
    ``record.py`` alone (``PatchRecord.of``, ``write_to``, ``remove_record``, ``carries_record``); every other module
    of the library goes through them. Counted: the name ``RECORD_KEY`` outside a message's f-string, and an attribute
    ``.hf_neural_attn`` (``torch.ops.hf_neural_attn``, the kernels' operator namespace, is another thing)."""
    found = []
    for name, path in MODULES.items():
        if not name.startswith("hf_neural_attn") or name == "hf_neural_attn.record":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        in_messages = {
            id(node) for text in ast.walk(tree) if isinstance(text, ast.JoinedStr) for node in ast.walk(text)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "RECORD_KEY" and id(node) not in in_messages:
                found.append(f"{name}:{node.lineno} reads RECORD_KEY")
            operator_namespace = isinstance(node, ast.Attribute) and getattr(node.value, "attr", None) == "ops"
            if isinstance(node, ast.Attribute) and node.attr == "hf_neural_attn" and not operator_namespace:
                found.append(f"{name}:{node.lineno} reads .hf_neural_attn")
    assert found == []


def test_the_library_does_not_import_the_recipes():
    graph = internal_graph()
    assert [
        (n, t) for n, ts in graph.items() if n.startswith("hf_neural_attn") for t in ts if t.startswith("recipes")
    ] == []


def test_recipes_import_only_public_names_of_the_library():
    private = []
    for name in MODULES:
        if not name.startswith("recipes"):
            continue
        for target, imported, line in imports_of(name):
            if not target.startswith("hf_neural_attn"):
                continue
            if target not in PUBLIC_MODULES or (imported or "").startswith("_"):
                private.append(f"{name}:{line} imports {target}{'.' + imported if imported else ''}")
    assert private == []


def test_recipes_read_no_private_attribute_of_the_library():
    """``hf_neural_attn._x`` or ``plotting._x`` in recipe code reaches past the public API as much as an import."""
    pattern = re.compile(r"\b(?:hf_neural_attn|plotting|scorers)\._\w+")
    found = [
        f"{name}: {match}"
        for name, path in MODULES.items()
        if name.startswith("recipes")
        for match in pattern.findall(path.read_text())
    ]
    assert found == []


def test_the_public_modules_are_the_ones_docs_api_lists():
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("## Public modules", 1)
    assert len(section) == 2, "docs/api.md has no 'Public modules' section"
    listed = set(re.findall(r"`(hf_neural_attn(?:\.\w+)*)`", section[1].split("\n## ", 1)[0]))
    assert listed == set(PUBLIC_MODULES)


def test_library_modules_do_not_import_the_package_root():
    """``from . import __version__`` made a module depend on the package ``__init__``, which imports everything."""
    graph = internal_graph()
    library = [name for name in graph if name.startswith("hf_neural_attn.")]
    assert sorted(name for name in library if "hf_neural_attn" in graph[name]) == []


# --- only the scorer knows the scorer ---------------------------------------------------------------------------


def code_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant in ``source`` that is code: docstrings, and any other string standing
    alone as a statement, are prose and left out; f-strings count by their literal parts."""
    tree = ast.parse(source)
    prose = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
    )


def scorer_name_mentions(source: str, names: Iterable[str]) -> list[tuple[int, str]]:
    """(line, text) of every string in the code of ``source`` that is one of the scorer ``names`` or holds
    ``--scorer <name>`` (a recipe flag naming one)."""
    names = set(names)
    alternatives = "|".join(re.escape(name) for name in sorted(names))
    flag = re.compile(rf"--scorer(?:\s+|=)(?:{alternatives})\b")
    return [(line, text) for line, text in code_strings(source) if text in names or flag.search(text)]


def scorer_names_in(package: str) -> list[str]:
    """Where the modules of ``package`` outside ``hf_neural_attn.scorers`` (the scorers and their registry) name a
    registered scorer, as "module:line: text"."""
    return [
        f"{name}:{line}: {text!r}"
        for name, path in MODULES.items()
        if (name == package or name.startswith(package + ".")) and not name.startswith("hf_neural_attn.scorers")
        for line, text in scorer_name_mentions(path.read_text(), SCORERS)
    ]


def test_the_scorer_name_scanner_finds_names_in_code_and_not_in_prose():
    snippet = '''
"""A module about qana."""


def pick(scorer, width):
    """Pass --scorer qana."""
    "a bare note on neural"
    if scorer.name == "qana":  # a comparison on the name
        return {"neural": width}
    options = ["--scorer", "general", "--scorer none", "qanas"]
    return f"run --scorer neural --h {width}" + "see --scorer=additive"
'''
    assert scorer_name_mentions(snippet, ["qana", "neural", "general", "additive"]) == [
        (8, "qana"),
        (9, "neural"),
        (10, "general"),
        (11, "run --scorer neural --h "),
        (11, "see --scorer=additive"),
    ]


def test_no_scorer_name_in_the_library_outside_the_scorers():
    """A scorer's name, its auto threshold, its fused form and its dot-product view live in ``hf_neural_attn.scorers``
    (one module and one registry line per scorer); the compute paths, plotting and the rest ask the scorer."""
    assert scorer_names_in("hf_neural_attn") == []


def test_no_scorer_name_in_the_recipes():
    """The recipes take the scorer as data (``--scorer``, its options from the scorer's config) and never name one."""
    assert scorer_names_in("recipes") == []


# --- only the narrow-key module knows the narrow-key option -----------------------------------------------------

# The option's name, which only the scorer that declares it (its config answers ``narrow_key_dim``) and the module
# holding what it means to the rest of the library may use.
NARROW_KEY_OPTION = "key_dim"
NARROW_KEY_MODULES = ("hf_neural_attn.narrow_keys", "hf_neural_attn.scorers.qana")


def option_name_uses(source: str, option: str) -> list[tuple[int, str]]:
    """(line, how) of every use of ``option`` in the code of ``source``: a name, an attribute, a parameter, a keyword,
    or a string of code holding it (f-strings by their literal parts; docstrings and comments are prose)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == option:
            found.append((node.lineno, "name"))
        elif isinstance(node, ast.Attribute) and node.attr == option:
            found.append((node.lineno, "attribute"))
        elif isinstance(node, ast.arg) and node.arg == option:
            found.append((node.lineno, "parameter"))
        elif isinstance(node, ast.keyword) and node.arg == option:
            found.append((node.lineno, "keyword"))
    found += [(line, "string") for line, text in code_strings(source) if option in text]
    return sorted(found)


def test_the_option_scanner_finds_uses_in_code_and_not_in_prose():
    snippet = '''
"""A module about key_dim."""


def width(config, key_dim=None):
    """Reads key_dim."""
    # a comment on key_dim
    value = config.key_dim or options.get("key_dim")
    return f"key_dim={value}", make(key_dim=value), key_dim
'''
    assert option_name_uses(snippet, "key_dim") == [
        (5, "parameter"),
        (8, "attribute"),
        (8, "string"),
        (9, "keyword"),
        (9, "name"),
        (9, "string"),
    ]


def test_no_module_outside_the_narrow_key_module_names_the_narrow_key_option():
    """The narrow-key option is declared by its scorer (``ScorerConfig.narrow_key_dim``) and what it means to the
    rest of the library (the narrow projections, the refusals, the questions asked of a model or a record) lives in
    ``hf_neural_attn/narrow_keys.py``: no other library module reads the option by its name."""
    found = [
        f"{name}:{line} {how}"
        for name, path in MODULES.items()
        if name.startswith("hf_neural_attn") and name not in NARROW_KEY_MODULES
        for line, how in option_name_uses(path.read_text(), NARROW_KEY_OPTION)
    ]
    assert found == []


# ------------------------------------------------------------------------------------- the recipe rooms

# The longest a recipe function may be (its ``def`` line to its last line, docstring included).
RECIPE_FUNCTION_LINES = 80
# The same rule for the library (the Triton kernels' bodies in ops/triton/ included).
LIBRARY_FUNCTION_LINES = 80


def string_constants_equal_to(source: str, words: set[str]) -> list[tuple[int, str]]:
    """(line, text) of every string in the code of ``source`` that is one of ``words`` (docstrings may name a task in
    their examples)."""
    return [(line, text) for line, text in code_strings(source) if text in words]


def functions_longer_than(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit`` lines, nested ones included."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_recipe_scanners_find_what_they_look_for():
    source = '"""A module about clm."""\n\ndef f(task):\n    """clm"""\n    return task == "clm" or f"{task}" == "x"\n'
    assert string_constants_equal_to(source, {"clm"}) == [(5, "clm")]
    assert functions_longer_than("def g():\n" + "    x = 1\n" * 80, RECIPE_FUNCTION_LINES) == [("g", 81)]
    assert functions_longer_than("def g():\n" + "    x = 1\n" * 79, RECIPE_FUNCTION_LINES) == []


def long_functions_in(package: str, limit: int) -> list[str]:
    """``module.function: N lines`` for every function of ``package`` longer than ``limit`` lines."""
    return [
        f"{name}.{function}: {lines} lines"
        for name, path in MODULES.items()
        if name == package or name.startswith(package + ".")
        for function, lines in functions_longer_than(path.read_text(), limit)
    ]


def test_no_recipe_function_is_longer_than_the_limit():
    long = long_functions_in("recipes", RECIPE_FUNCTION_LINES)
    assert long == [], f"recipe functions over {RECIPE_FUNCTION_LINES} lines: {long}"


def test_no_library_function_is_longer_than_the_limit():
    """A long function is a list of steps without names: each step a function of its own reads as what it does."""
    long = long_functions_in("hf_neural_attn", LIBRARY_FUNCTION_LINES)
    assert long == [], f"library functions over {LIBRARY_FUNCTION_LINES} lines: {long}"


def test_no_recipe_module_outside_the_tasks_names_a_task():
    """A task is one module in recipes/tasks/ and one line in its registry: no other recipe module may branch on a
    task's name or kind (the registry is imported to learn them). recipes/metrics/ holds standalone `evaluate`
    scripts loaded by path, which keep the GLUE names of the metric they compute."""
    from recipes.tasks import TASKS

    words = set(TASKS) | {task_class.kind for task_class in TASKS.values()}
    found = [
        f"{name}:{line} {text!r}"
        for name, path in MODULES.items()
        if name.startswith("recipes") and not name.startswith(("recipes.tasks", "recipes.metrics"))
        for line, text in string_constants_equal_to(path.read_text(), words)
    ]
    assert found == []


def test_the_sweep_does_not_import_the_finetune_command():
    """``recipes.finetune`` is one run's command line; the sweep runs ``recipes.training.run`` and reads the flags'
    helpers from ``recipes.args``, so that a sweep never depends on a command (and the command may grow freely)."""
    graph = internal_graph()
    sweep = [name for name in graph if name == "recipes.sweep" or name.startswith("recipes.sweep.")]
    assert sweep and [name for name in sweep if "recipes.finetune" in graph[name]] == []


# --- one room for what the library changes in other libraries ---------------------------------------------------

# What the library changes in other libraries lives in one folder, each change a row of its table; the private
# names of other libraries are read there and behind the accessors of the ground floor's compat/ folder.
CHANGING_ROOM = ("hf_neural_attn.integrations",)
READING_ROOM = ("hf_neural_attn.compat", "hf_neural_attn.integrations")
ACCESSORS = "hf_neural_attn.compat.internals"
# The libraries the library extends or reads (the standard library is Python's, not "another library").
OTHER_LIBRARIES = frozenset(
    {
        "accelerate",
        "bitsandbytes",
        "deepspeed",
        "huggingface_hub",
        "lm_eval",
        "peft",
        "safetensors",
        "sentence_transformers",
        "torch",
        "torchao",
        "transformers",
        "triton",
        "vllm",
    }
)
# Python's public namedtuple API, whose names start with an underscore so as not to clash with field names.
# The prefix of the attributes the library sets on other libraries' objects (a scorer's shards, a config's record).
OWN_ATTRIBUTE_PREFIX = "_hf_neural_attn"
NAMEDTUPLE_API = frozenset({"_make", "_replace", "_asdict", "_fields", "_field_defaults"})
# torch.nn.Module's ``_apply`` is the extension point torch itself overrides for ``.to()``/``to_empty()``; the scorer
# base overrides it to draw its init once a meta model gets storage (scorers/base.py says why). The one exception.
OVERRIDDEN_PRIVATE_METHODS = frozenset({("hf_neural_attn.scorers.base", "_apply")})


def outside(name: str, room: tuple[str, ...]) -> bool:
    """Whether library module ``name`` lies outside every package of ``room``."""
    inside = any(name == package or name.startswith(package + ".") for package in room)
    return name.startswith("hf_neural_attn") and not inside


def other_library_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> what it was imported as, for every import of another library in ``tree``."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OTHER_LIBRARIES:
                    names[alias.asname or alias.name.split(".")[0]] = alias.name
        elif (
            isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in OTHER_LIBRARIES
        ):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def private_part(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def library_defined_private_names() -> set[str]:
    """Every underscore name the library defines outside the room: functions, classes, assigned names and
    attributes, parameters, keys of dict literals (a class made with ``type()``). Accessing one of these is the
    library reading its own names."""
    defined = set()
    for name, path in MODULES.items():
        if not outside(name, READING_ROOM):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.Dict):
                defined.update(key.value for key in node.keys if isinstance(key, ast.Constant))
    return {name for name in defined if isinstance(name, str) and name.startswith("_") and not name.startswith("__")}


def room_private_names() -> set[str]:
    """The private names of other libraries the room's accessors read: an underscore attribute, keyword or string in
    ``compat/internals.py``. These are other libraries' even where the library also defines one (the patched config
    class's descriptor for transformers' implementation field)."""
    source = MODULES[ACCESSORS].read_text()
    tree = ast.parse(source)
    found = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found |= {node.arg for node in ast.walk(tree) if isinstance(node, ast.keyword) and node.arg}
    found |= {value for _, value in code_strings(source)}
    return {name for name in found if name.startswith("_") and not name.startswith("__")}


def private_reads(name: str, source: str, ours: set[str], theirs: set[str]) -> list[str]:
    """Where ``source`` (module ``name``) reads a private name of another library: an import of one, an underscore
    attribute or keyword the library does not define (or one of ``theirs``), a string naming one of ``theirs``."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"{name}:{node.lineno} imports {alias.name}"
                for alias in node.names
                if alias.name.split(".")[0] in OTHER_LIBRARIES and private_part(alias.name)
            ]
        elif (
            isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in OTHER_LIBRARIES
        ):
            found += [
                f"{name}:{node.lineno} imports {node.module}.{alias.name}"
                for alias in node.names
                if private_part(f"{node.module}.{alias.name}")
            ]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            standard_library = isinstance(node.value, ast.Name) and node.value.id in ("sys", "os", "inspect")
            if (name, node.attr) in OVERRIDDEN_PRIVATE_METHODS or node.attr in NAMEDTUPLE_API or standard_library:
                continue
            if node.attr in theirs or node.attr not in ours:
                found.append(f"{name}:{node.lineno} reads .{node.attr}")
        elif (
            isinstance(node, ast.keyword)
            and (node.arg or "").startswith("_")
            and (node.arg in theirs or node.arg not in ours)
        ):
            found.append(f"{name}:{node.lineno} passes {node.arg}=")
    for line, text in code_strings(source):
        dotted_module = text.split(".")[0] in OTHER_LIBRARIES and private_part(text) and " " not in text
        # A private name read as a string (getattr(x, "_name"), vars(x).get("_name")) is read all the same; the
        # attributes the library sets on other libraries' objects carry its prefix, and are its own.
        private_name = (
            text.isidentifier()
            and text.startswith("_")
            and not text.startswith(("__", OWN_ATTRIBUTE_PREFIX))
            and text not in ours
        )
        if text in theirs or dotted_module or private_name:
            found.append(f"{name}:{line} names {text!r}")
    return found


def private_overrides(module: ModuleType) -> list[str]:
    """Where a class of ``module`` (imported) defines a private method that a base class of another library defines
    too: an override of a name that library promises nothing about."""
    found = []
    for cls in vars(module).values():
        if not isinstance(cls, type) or cls.__module__ != module.__name__:
            continue
        for attribute, value in vars(cls).items():
            if not attribute.startswith("_") or attribute.startswith("__"):
                continue
            function = getattr(value, "__func__", getattr(value, "fget", value))
            if getattr(function, "__module__", None) != module.__name__:
                continue  # not written in the class (torch's Function metaclass adds ``_backward_cls``)
            if (module.__name__, attribute) in OVERRIDDEN_PRIVATE_METHODS:
                continue
            theirs = [
                base
                for base in cls.__mro__[1:]
                if base.__module__.split(".")[0] in OTHER_LIBRARIES and attribute in vars(base)
            ]
            if theirs:
                found.append(f"{module.__name__}.{cls.__qualname__}.{attribute} overrides {theirs[0].__qualname__}'s")
    return found


def assignments_into_other_libraries(name: str, source: str) -> list[str]:
    """Where ``source`` (module ``name``) changes another library: an attribute of an imported module or class
    assigned or deleted, ``setattr``/``delattr`` on one, a ``register`` call on one (a registry of theirs), or an
    import hook placed on ``sys.meta_path``."""
    tree = ast.parse(source)
    imported = other_library_names(tree)

    def rooted_in_other_library(node: ast.AST) -> bool:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return isinstance(node, ast.Name) and node.id in imported

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if rooted_in_other_library(node.value):
                found.append(f"{name}:{node.lineno} assigns {ast.unparse(node)}")
            if ast.unparse(node.value) == "sys.meta_path":
                found.append(f"{name}:{node.lineno} changes sys.meta_path")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and rooted_in_other_library(node.args[0]):
                found.append(f"{name}:{node.lineno} calls {ast.unparse(node)[:80]}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "register" and rooted_in_other_library(node.func.value):
                found.append(f"{name}:{node.lineno} registers in {ast.unparse(node.func.value)}")
            if ast.unparse(node.func.value) == "sys.meta_path":
                found.append(f"{name}:{node.lineno} changes sys.meta_path")
    return found


def test_the_room_scanners_find_what_they_look_for():
    changes = """
import sys
from transformers import AttentionInterface, PreTrainedModel
from transformers.utils import hub as transformers_hub

PreTrainedModel.save_pretrained = None
setattr(transformers_hub, "create_and_tag_model_card", None)
AttentionInterface.register("x", None)
sys.meta_path.insert(0, None)
own = object()
own.value = 1
"""
    assert [line.split(" ", 1)[1] for line in assignments_into_other_libraries("m", changes)] == [
        "assigns PreTrainedModel.save_pretrained",
        "calls setattr(transformers_hub, 'create_and_tag_model_card', None)",
        "registers in AttentionInterface",
        "changes sys.meta_path",
    ]
    reads = """
import torch._dynamo
from transformers.utils.output_capturing import _active_collector
x = config._attn_implementation
y = model._own_name
z = sys._getframe(1)
cached_file(path, _raise_exceptions_for_missing_entries=False)
w = vars(config).get("_tp_plan")
m = "torch.distributed.tensor.experimental._context_parallel"
h = getattr(module, "_is_hooked", False)
o = getattr(model, "_own_name", None)
"""
    found = [line.split(" ", 1)[1] for line in private_reads("m", reads, ours={"_own_name"}, theirs={"_tp_plan"})]
    assert found == [
        "imports torch._dynamo",
        "imports transformers.utils.output_capturing._active_collector",
        "reads ._attn_implementation",
        "passes _raise_exceptions_for_missing_entries=",
        "names '_tp_plan'",
        "names 'torch.distributed.tensor.experimental._context_parallel'",
        "names '_is_hooked'",
    ]


def test_the_override_scanner_finds_private_methods_of_other_libraries():
    module = ModuleType("somewhere")
    exec(
        """
from torch import nn

class Block(nn.Module):
    def _apply(self, fn, recurse=True):  # torch's
        return super()._apply(fn, recurse)

    def _own_helper(self):  # ours alone
        return 1

    def forward(self, x):
        return x

class Inner(Block):
    def _load_from_state_dict(self, *args):  # torch's, two classes down
        pass
""",
        vars(module),
    )
    assert private_overrides(module) == [
        "somewhere.Block._apply overrides Module's",
        "somewhere.Inner._load_from_state_dict overrides Module's",
    ]


def test_only_the_integrations_room_changes_other_libraries():
    """What the library changes in transformers, torch, DeepSpeed, vLLM (wrapped methods, registrations, import hooks)
    is done in ``hf_neural_attn/integrations/`` alone, and listed in its table (``integrations/installer.py``)."""
    found = [
        change
        for name, path in MODULES.items()
        if outside(name, CHANGING_ROOM)
        for change in assignments_into_other_libraries(name, path.read_text())
    ]
    assert found == []


def test_only_the_integrations_room_reads_private_names_of_other_libraries():
    """transformers', torch's, accelerate's and DeepSpeed's underscore names are read in the integrations room alone:
    by the accessors of ``compat/internals.py`` for the rest of the library, and in ``integrations/``. An upgrade of
    those libraries is reviewed in two folders."""
    ours, theirs = library_defined_private_names(), room_private_names()
    assert {"_attn_implementation_internal", "_is_hf_initialized", "_tp_plan"} <= theirs
    found = [
        read
        for name, path in MODULES.items()
        if outside(name, READING_ROOM)
        for read in private_reads(name, path.read_text(), ours - theirs, theirs)
    ]
    assert found == []


def test_no_class_outside_the_room_overrides_a_private_method_of_another_library():
    """A class of the library that subclasses one of another library's (an ``nn.Module``, a transformers config) may
    override its public methods only: a private one is a name that library may rename in any release. The one
    exception (``OVERRIDDEN_PRIVATE_METHODS``) says why. Modules are imported: the bases' methods are looked up."""
    found = [
        override
        for name in MODULES
        if outside(name, READING_ROOM)
        for override in private_overrides(importlib.import_module(name))
    ]
    assert found == []
