"""The layers of `slurm_cdgpc`, read from its source: which module may import, or run, what.

Every module under ``slurm_cdgpc/`` is parsed with `ast`, and every import counts: at module
level, inside functions, under ``TYPE_CHECKING``, relative ones resolved, and
``importlib.import_module``/``__import__`` of a constant name. Each rule is one row of a table
below; a failure names the module, the import (or the program) and the rule. DESIGN.md ("Data
flow") says why the layers are what they are.

A module runs a program when it holds an absolute path ending in the program's name
(``"/usr/bin/scontrol"``) anywhere, or the program's name in an argv place: the first item of a
list or tuple display, or the first argument (its first word) of a ``subprocess``,
``os.system``, ``os.popen``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*``,
``asyncio.create_subprocess_*`` or ``shutil.which`` call. A name in such a place counts as the
strings it may be bound to: a module constant, a parameter's default, a constant imported from
another module.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import pytest

PACKAGE = "slurm_cdgpc"
REPO = Path(__file__).resolve().parents[2]
STDLIB = frozenset(sys.stdlib_module_names)

# -- the rules ---------------------------------------------------------------------------------

#: (layer, the layers it never reaches, directly or through anything it imports)
NEVER_REACHES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("control", ("store", "transport", "agent", "coordinator", "cli")),
    ("model", ("store", "transport", "agent", "coordinator", "cli")),
    ("agent", ("control",)),
    ("store", ("coordinator",)),
    # the transports and the Prolog/Epilog serve both parties: they import neither
    ("transport", ("agent", "coordinator")),
    ("slurm", ("agent", "coordinator")),
    # the power-domain file: read by the head, turned into the controller's input
    ("topology", ("store", "transport", "agent", "coordinator", "cli")),
)

#: (layer, the only layers of the package it reaches): the GPU floor. `wire`, `errors` and
#: `units` are the ground floor: they import the standard library and `errors` alone.
ONLY_REACHES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gpu", ("gpu", "wire", "errors", "units")),
)

#: (layer, all it reaches beyond the standard library and its own modules). `wire` is the
#: head–node contract, imported by both and by the progress client inside training jobs. The
#: hook runs inside users' jobs without the package on the path: its modules import each other
#: by their own names, and the ``torch`` it imports is the job's own, once the job imported it.
STDLIB_ONLY: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("wire", ("slurm_cdgpc.errors",)),
    ("hook", ("_cdgpc_progress_hook", "torch")),
)

#: (third-party module, the only layers or modules that import it)
SEAMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pynvml", ("slurm_cdgpc.gpu.nvml",)),
    ("pyslurm", ("slurm",)),
)

#: (programs, the only layers that run them)
PROGRAMS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("squeue", "scontrol", "sinfo", "sacct", "sbatch", "srun", "scancel"), ("slurm",)),
    (("munge", "unmunge", "ssh"), ("transport",)),
)

#: where the scripts Slurm runs at every job's start and end live: what they import, and all
#: that pulls in at import time (each package's ``__init__`` on the way included), is the
#: standard library and this package alone
HOOK_SCRIPT_DIRS: tuple[str, ...] = ("prolog", "epilog")

# -- reading the source ------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (a package's submodule where one is named)
    line: int
    at_import_time: bool  # module level and not under TYPE_CHECKING: runs when the module loads


@dataclass
class Module:
    """One module, and what one walk over its syntax tree finds in it."""

    name: str  # dotted: slurm_cdgpc.gpu.board
    path: str  # for messages: slurm_cdgpc/gpu/board.py
    is_package: bool
    #: (module named, names imported from it or None for ``import x``, line, at import time)
    raw_imports: list[tuple[str, tuple[tuple[str, str | None], ...] | None, int, bool]]
    #: module constants and parameters' defaults: (name, value expression), in source order
    bindings: list[tuple[str, ast.expr]]
    #: local name → what it stands for: ``sp`` → ``subprocess``, ``run`` → ``subprocess.run``
    aliases: dict[str, str]
    #: (line, expression, whether it is a command line): what may name a program to run
    argv: list[tuple[int, ast.expr, bool]]

    @property
    def layer(self) -> str:
        """``gpu`` for ``slurm_cdgpc.gpu.board``, ``config`` for ``slurm_cdgpc.config``."""
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    @classmethod
    def parse(cls, name: str, path: str, text: str, is_package: bool) -> Module:
        module = cls(name, path, is_package, [], [], {}, [])
        tree = ast.parse(text, path)
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                module.bindings += [(t.id, stmt.value) for t in targets if isinstance(t, ast.Name)]
        for node, now in _walk(tree, True):
            module._see(node, now)
        return module

    def _see(self, node: ast.AST, now: bool) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                self.raw_imports.append((a.name, None, node.lineno, now))
                self.aliases[a.asname or _top(a.name)] = a.name if a.asname else _top(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = self._base(node)
            names = tuple((a.name, a.asname) for a in node.names)
            self.raw_imports.append((base, names, node.lineno, now))
            self.aliases.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names})
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = node.args
            positional = [*params.posonlyargs, *params.args]
            defaults = params.defaults
            pairs = [
                *zip(positional[len(positional) - len(defaults) :], defaults, strict=True),
                *zip(params.kwonlyargs, params.kw_defaults, strict=True),
            ]
            self.bindings += [(arg.arg, d) for arg, d in pairs if d is not None]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("/"):
                self.argv.append((node.lineno, node, False))
        elif isinstance(node, ast.List | ast.Tuple) and node.elts:
            self.argv.append((node.lineno, node.elts[0], False))
        elif isinstance(node, ast.Call) and node.args:
            if (target := _dynamic_import(node)) is not None:
                self.raw_imports.append((target, None, node.lineno, now))
            else:
                self.argv.append((node.lineno, node, True))

    def _base(self, node: ast.ImportFrom) -> str:
        """The module ``from ... import`` names, relative levels resolved."""
        if not node.level:
            return node.module or ""
        parts = self.name.split(".")
        if not self.is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join([*parts, *([node.module] if node.module else [])])


def read_package(root: Path) -> dict[str, Module]:
    """Every module under ``root/slurm_cdgpc``, by dotted name."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        module = read_module(root, path.relative_to(root).as_posix())
        modules[module.name] = module
    return modules


def read_module(root: Path, path: str, text: str | None = None) -> Module:
    """The module at ``path`` (relative to ``root``), or ``text`` read as that module."""
    parts = path.removesuffix(".py").split("/")
    is_package = parts[-1] == "__init__"
    name = ".".join(parts[:-1] if is_package else parts)
    if text is None:
        text = (root / path).read_text(encoding="utf-8")
    return Module.parse(name, path, text, is_package)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, at_import_time: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node under ``node``, each with whether it runs when the module is imported."""
    for child in ast.iter_child_nodes(node):
        now = at_import_time and not isinstance(
            child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        yield child, now
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, False
                yield from _walk(stmt, False)
            for stmt in child.orelse:
                yield stmt, now
                yield from _walk(stmt, now)
        else:
            yield from _walk(child, now)


def _dynamic_import(node: ast.Call) -> str | None:
    """``x`` of ``importlib.import_module("x")`` or ``__import__("x")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__"):
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _parents(name: str) -> list[str]:
    """The packages Python imports before ``name``, outermost first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _top(name: str) -> str:
    return name.split(".", maxsplit=1)[0]


def _strings(node: ast.expr | None, names: Mapping[str, set[str]]) -> set[str]:
    """The strings ``node`` may hold: a literal, one wrapped (``Path("...")``), a bound name."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Call) and len(node.args) == 1:
        return _strings(node.args[0], names)
    if isinstance(node, ast.Name):
        return set(names.get(node.id, ()))
    return set()


class Graph:
    """The package's import graph, and the chains of imports by which one module reaches another."""

    def __init__(self, modules: Mapping[str, Module]) -> None:
        self.modules = dict(modules)
        self.edges: dict[str, list[Import]] = {}
        for module in self.modules.values():
            edges = self.edges[module.name] = []
            for base, names, line, now in module.raw_imports:
                if names is None:
                    edges.append(Import(module.name, base, line, now))
                    continue
                for name, _ in names:
                    sub = f"{base}.{name}"
                    edges.append(Import(module.name, sub if sub in modules else base, line, now))
        self._reach: dict[tuple[str, bool], dict[str, list[Import]]] = {}

    def changed(self, root: Path, path: str, text: str) -> Graph:
        """This graph with the module at ``path`` read from ``text`` instead."""
        module = read_module(root, path, text)
        return Graph({**self.modules, module.name: module})

    def in_layer(self, layer: str) -> list[Module]:
        return [m for m in self.modules.values() if m.layer == layer]

    def layer_of(self, name: str) -> str | None:
        module = self.modules.get(name)
        return None if module is None else module.layer

    def reach(self, start: str, *, import_time_only: bool = False) -> dict[str, list[Import]]:
        """Every module ``start`` reaches, each with the first chain of imports found to it
        (the package's modules are followed, any other is a leaf). ``import_time_only``: only
        what runs when ``start`` is imported, which includes every package ``__init__`` on
        the way."""
        key = (start, import_time_only)
        if key in self._reach:
            return self._reach[key]
        chains: dict[str, list[Import]] = {start: []}
        todo = deque([start])
        while todo:
            here = todo.popleft()
            for edge in self.edges.get(here, []):
                if import_time_only and not edge.at_import_time:
                    continue
                steps = [edge]
                if import_time_only:  # ``import a.b.c`` runs a and a.b first
                    steps = [replace(edge, target=p) for p in _parents(edge.target)] + steps
                for step in steps:
                    if step.target not in chains:
                        chains[step.target] = [*chains[here], step]
                        if step.target in self.modules:
                            todo.append(step.target)
        del chains[start]
        self._reach[key] = chains
        return chains

    def bound_strings(self) -> dict[str, dict[str, set[str]]]:
        """Module → name → the strings the name may hold: module constants, parameters'
        defaults, and constants imported from another module of the package."""
        bound: dict[str, dict[str, set[str]]] = {}
        for module in self.modules.values():
            names: dict[str, set[str]] = {}
            for name, value in module.bindings:
                names.setdefault(name, set()).update(_strings(value, names))
            bound[module.name] = names
        for module in self.modules.values():
            for base, imported, _, _ in module.raw_imports:
                source = bound.get(base, {})
                for name, asname in imported or ():
                    if name in source:
                        bound[module.name].setdefault(asname or name, set()).update(source[name])
        return bound

    def where(self, edge: Import) -> str:
        return f"{self.modules[edge.module].path}:{edge.line}: {edge.module} imports {edge.target}"

    def reached(self, chain: list[Import], target: str) -> str:
        """The first import of ``chain`` and, when it goes on, where it ends."""
        text = self.where(chain[0])
        if len(chain) > 1 or chain[0].target != target:
            text += f", which reaches {target} (via {' → '.join(e.module for e in chain[1:])})"
        return text


# -- the checks: each gives one line per violation ---------------------------------------------


def _reaching(graph: Graph, layer: str, bad: Callable[[str], bool], rule: str) -> list[str]:
    """A line for each ``bad`` module that a module of ``layer`` reaches through an import
    out of the layer (an import inside it is the imported module's to answer for), unless the
    chain to it went through a bad one already (that one is named)."""
    return [
        f"{graph.reached(chain, target)}: {rule}"
        for module in graph.in_layer(layer)
        for target, chain in graph.reach(module.name).items()
        if bad(target)
        and graph.layer_of(chain[0].target) != layer
        and not any(bad(e.target) for e in chain[:-1])
    ]


def never_reaches(graph: Graph, layer: str, forbidden: tuple[str, ...]) -> list[str]:
    rule = f"{layer}/ never reaches {', '.join(forbidden)}"
    return _reaching(graph, layer, lambda name: graph.layer_of(name) in forbidden, rule)


def only_reaches(graph: Graph, layer: str, allowed: tuple[str, ...]) -> list[str]:
    rule = f"{layer}/ reaches only {', '.join(allowed)} of the package"

    def bad(name: str) -> bool:
        inner = graph.layer_of(name)
        return inner is not None and name != PACKAGE and inner not in allowed

    return _reaching(graph, layer, bad, rule)


def stdlib_only(graph: Graph, layer: str, allowed: tuple[str, ...]) -> list[str]:
    rule = f"{layer}/ reaches only the standard library" + "".join(f", {a}" for a in allowed)
    own = f"{PACKAGE}.{layer}"

    def bad(name: str) -> bool:
        top = _top(name)
        inside = name == own or name.startswith(f"{own}.")
        return not (top in STDLIB or top in allowed or name in allowed or inside)

    return _reaching(graph, layer, bad, rule)


def seam(graph: Graph, third_party: str, owners: tuple[str, ...]) -> list[str]:
    rule = f"only {', '.join(owners)} imports {third_party}"
    return [
        f"{graph.where(edge)}: {rule}"
        for module in graph.modules.values()
        if module.name not in owners and module.layer not in owners
        for edge in graph.edges[module.name]
        if _top(edge.target) == third_party
    ]


_RUNNERS = frozenset(
    {
        "subprocess.run",
        "subprocess.Popen",
        "subprocess.call",
        "subprocess.check_call",
        "subprocess.check_output",
        "subprocess.getoutput",
        "subprocess.getstatusoutput",
        "shutil.which",
        "os.system",
        "os.popen",
        "asyncio.create_subprocess_exec",
        "asyncio.create_subprocess_shell",
    }
)
_RUNNER_PREFIXES = ("os.exec", "os.spawn", "os.posix_spawn")


def _dotted(node: ast.expr, aliases: Mapping[str, str]) -> str:
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value, aliases)}.{node.attr}"
    return ""


def runs(graph: Graph, programs: frozenset[str]) -> Iterator[tuple[Module, int, str]]:
    """(module, line, program) for every place a module names one of ``programs`` to run it."""
    bound = graph.bound_strings()
    for module in graph.modules.values():
        names = bound[module.name]
        for line, node, command_line in module.argv:
            held = node
            if isinstance(node, ast.Call):
                func = _dotted(node.func, module.aliases)
                if func not in _RUNNERS and not func.startswith(_RUNNER_PREFIXES):
                    continue
                held = node.args[0]
            for value in _strings(held, names):
                words = value.split()
                if not words or (not command_line and len(words) > 1):
                    continue
                program = words[0].rsplit("/", 1)[-1]
                if program in programs:
                    yield module, line, program


def runs_programs(graph: Graph, programs: tuple[str, ...], owners: tuple[str, ...]) -> list[str]:
    rule = f"only {', '.join(owners)}/ runs {', '.join(programs)}"
    return sorted(
        {
            f"{module.path}:{line}: {module.name} runs {name}: {rule}"
            for module, line, name in runs(graph, frozenset(programs))
            if module.layer not in owners
        }
    )


def hook_scripts(root: Path, dirs: Iterable[str]) -> dict[str, list[str]]:
    """Script → the modules it imports, for every Python script in ``dirs``."""
    scripts: dict[str, list[str]] = {}
    for directory in dirs:
        for path in sorted((root / directory).iterdir()):
            text = path.read_text(encoding="utf-8") if path.is_file() else ""
            if not text.startswith("#!") or "python" not in text.splitlines()[0]:
                continue
            names: list[str] = []
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, ast.Import):
                    names += [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names.append(node.module)
            scripts[path.relative_to(root).as_posix()] = names
    return scripts


def import_chain(graph: Graph, script: str, entries: list[str]) -> list[str]:
    """A line for each module outside the standard library and the package that ``script``
    pulls in, named once, with the import that does it and a chain from the script to it."""
    rule = f"{script} pulls in only the standard library and {PACKAGE} at import time"
    lines: dict[tuple[str, str], str] = {}
    starts = [name for entry in entries for name in [*_parents(entry), entry]]
    for entry in dict.fromkeys(starts):  # the script's imports and their packages, in order
        if _top(entry) in STDLIB:
            continue
        if entry not in graph.modules:
            lines[script, entry] = f"{script}: imports {entry}, not the standard library: {rule}"
            continue
        for target, chain in graph.reach(entry, import_time_only=True).items():
            key = (chain[-1].module, _top(target))
            if _top(target) not in STDLIB and _top(target) != PACKAGE and key not in lines:
                via = " → ".join([entry, *(e.target for e in chain)])
                lines[key] = f"{graph.where(chain[-1])} ({via}): {rule}"
    return list(lines.values())


def violations(graph: Graph) -> list[str]:
    """Every rule above, over ``graph``."""
    found = [line for row in NEVER_REACHES for line in never_reaches(graph, *row)]
    found += [line for row in ONLY_REACHES for line in only_reaches(graph, *row)]
    found += [line for row in STDLIB_ONLY for line in stdlib_only(graph, *row)]
    found += [line for row in SEAMS for line in seam(graph, *row)]
    found += [line for row in PROGRAMS for line in runs_programs(graph, *row)]
    scripts = hook_scripts(REPO, HOOK_SCRIPT_DIRS)
    return found + [line for s, names in scripts.items() for line in import_chain(graph, s, names)]


# -- the tests ---------------------------------------------------------------------------------


@cache
def _graph() -> Graph:
    return Graph(read_package(REPO))


@cache
def _violations() -> list[str]:
    return violations(_graph())


def _fail_on(lines: list[str]) -> None:
    if lines:
        pytest.fail(f"{len(lines)} violation(s):\n" + "\n".join(lines), pytrace=False)


@pytest.mark.parametrize(("layer", "forbidden"), NEVER_REACHES, ids=[r[0] for r in NEVER_REACHES])
def test_a_layer_never_reaches_the_ones_above(layer: str, forbidden: tuple[str, ...]) -> None:
    assert _graph().in_layer(layer), f"no modules in {layer}/"
    _fail_on(never_reaches(_graph(), layer, forbidden))


@pytest.mark.parametrize(("layer", "allowed"), ONLY_REACHES, ids=[r[0] for r in ONLY_REACHES])
def test_the_gpu_floor_reaches_only_the_ground(layer: str, allowed: tuple[str, ...]) -> None:
    assert _graph().in_layer(layer), f"no modules in {layer}/"
    _fail_on(only_reaches(_graph(), layer, allowed))


@pytest.mark.parametrize(("layer", "allowed"), STDLIB_ONLY, ids=[r[0] for r in STDLIB_ONLY])
def test_standard_library_only(layer: str, allowed: tuple[str, ...]) -> None:
    assert _graph().in_layer(layer), f"no modules in {layer}/"
    _fail_on(stdlib_only(_graph(), layer, allowed))


@pytest.mark.parametrize(("third_party", "owners"), SEAMS, ids=[r[0] for r in SEAMS])
def test_one_module_imports_each_vendor_library(third_party: str, owners: tuple[str, ...]) -> None:
    _fail_on(seam(_graph(), third_party, owners))


@pytest.mark.parametrize(("programs", "owners"), PROGRAMS, ids=[r[1][0] for r in PROGRAMS])
def test_one_layer_runs_each_program(programs: tuple[str, ...], owners: tuple[str, ...]) -> None:
    _fail_on(runs_programs(_graph(), programs, owners))


def test_the_prolog_and_epilog_pull_in_the_standard_library_only() -> None:
    scripts = hook_scripts(REPO, HOOK_SCRIPT_DIRS)
    assert {"prolog/cdgpc-prolog", "prolog/cdgpc-task-prolog", "epilog/cdgpc-epilog"} <= set(
        scripts
    )
    assert all(scripts.values()), f"a hook script imports nothing: {scripts}"
    _fail_on([line for s, names in scripts.items() for line in import_chain(_graph(), s, names)])


def test_the_detectors_see_todays_seams() -> None:
    """Each rule passes because the code keeps it, not because its detector sees nothing."""
    graph = _graph()
    every = frozenset(p for programs, _ in PROGRAMS for p in programs)
    ran = {(m.layer, name) for m, _, name in runs(graph, every)}
    assert {("slurm", "scontrol"), ("slurm", "squeue"), ("slurm", "sbatch")} <= ran
    assert {("transport", "munge"), ("transport", "unmunge"), ("transport", "ssh")} <= ran
    assert any(e.target == "pynvml" for e in graph.edges["slurm_cdgpc.gpu.nvml"])
    assert any(e.target == "pyslurm" for e in graph.edges["slurm_cdgpc.slurm.pyslurm_jobs"])
    chain = graph.reach("slurm_cdgpc.slurm.hooks", import_time_only=True)
    assert {"slurm_cdgpc", "slurm_cdgpc.slurm", "slurm_cdgpc.config", "os"} <= set(chain)
    assert "numpy" in graph.reach("slurm_cdgpc.gpu.plant", import_time_only=True)


#: (file, what is put back at its end, what the failure then names): one per kind of rule
PUT_BACK: tuple[tuple[str, str, str], ...] = (
    (
        "slurm_cdgpc/gpu/workloads.py",
        "from slurm_cdgpc.agent.progress import report_progress",
        "slurm_cdgpc.gpu.workloads imports slurm_cdgpc.agent.progress",
    ),
    (
        "slurm_cdgpc/transport/http.py",
        "from slurm_cdgpc.agent.node import NodeAgent",
        "slurm_cdgpc.transport.http imports slurm_cdgpc.agent.node",
    ),
    (
        "slurm_cdgpc/wire/protocol.py",
        "if TYPE_CHECKING:\n    from slurm_cdgpc.gpu.board import spec_from_board",
        "slurm_cdgpc.wire.protocol imports slurm_cdgpc.gpu.board",
    ),
    (
        "slurm_cdgpc/control/dual.py",
        "def _late() -> None:\n    from ..store import repository",
        "slurm_cdgpc.control.dual imports slurm_cdgpc.store.repository",
    ),
    (
        "slurm_cdgpc/slurm/comment.py",
        "import numpy",
        "slurm_cdgpc.slurm.comment imports numpy",
    ),
    (
        "slurm_cdgpc/transport/__init__.py",
        "import sqlalchemy",
        "slurm_cdgpc.transport imports sqlalchemy",
    ),
    (
        "slurm_cdgpc/slurm/__init__.py",
        "from ..cli import main",
        "imports click (slurm_cdgpc.slurm → slurm_cdgpc.cli.main → click)",
    ),
    (
        "slurm_cdgpc/coordinator/reconcile.py",
        "import subprocess\nSCANCEL = 'scancel'\n"
        "def _cancel(job: str, cmd: str = SCANCEL) -> None:\n    subprocess.run([cmd, job])",
        "slurm_cdgpc.coordinator.reconcile runs scancel",
    ),
    (
        "slurm_cdgpc/cli/admin.py",
        "import os\n_ = os.system('sinfo -h')",
        "slurm_cdgpc.cli.admin runs sinfo",
    ),
    (
        "slurm_cdgpc/sim/sweep.py",
        "SRUN = Path('/usr/bin/srun')",
        "slurm_cdgpc.sim.sweep runs srun",
    ),
    (
        "slurm_cdgpc/doctor.py",
        "import shutil as sh\nMUNGE = 'munge'\n_HAVE = sh.which(MUNGE)",
        "slurm_cdgpc.doctor runs munge",
    ),
    (
        "slurm_cdgpc/sim/fleet.py",
        "import importlib\n_NVML = importlib.import_module('pynvml')",
        "slurm_cdgpc.sim.fleet imports pynvml",
    ),
    (
        "slurm_cdgpc/hook/sitecustomize.py",
        "def _f():\n    from slurm_cdgpc.wire import protocol",
        "slurm_cdgpc.hook.sitecustomize imports slurm_cdgpc.wire.protocol",
    ),
)


@pytest.mark.parametrize(("path", "line", "named"), PUT_BACK, ids=[p[0] for p in PUT_BACK])
def test_an_import_put_back_is_reported(path: str, line: str, named: str) -> None:
    text = (REPO / path).read_text(encoding="utf-8")
    broken = violations(_graph().changed(REPO, path, f"{text}\n{line}\n"))
    assert any(named in found for found in broken), broken
    assert not any(named in found for found in _violations()), "the real tree breaks it too"
