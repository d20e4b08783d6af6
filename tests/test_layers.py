"""The folders are the architecture: every import of the project obeys the layer edges.

    kvscope/              the CLI and the composition roots        → anything
    dashboard/            Streamlit, rules, Grafana, timelines     → analyzers, contract, reader
    analyzers/            pandas analyses and importers            → contract, run store reader
    instrumented_engine/  our engine and the engine observers      → agent.telemetry, contract
    collectors/           NVML, NIC, RDMA, host                    → agent
    agent/                the telemetry plane (contract at bottom) → nothing else

The check walks the AST of every module: module-level and function-level `import` and
`from ... import` statements (relative ones resolved), and the string targets of
`importlib.import_module(...)` / `__import__(...)`. There is no allow-list: a module that needs
an edge this table does not have belongs in another layer. See docs/DESIGN.md, "Layers".
"""

from __future__ import annotations

import ast
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "collectors", "instrumented_engine", "analyzers", "dashboard", "kvscope")

#: The contract everyone may import: the vocabulary, schemas and metric catalogue, the clock,
#: the error types, the interval algebra of the partition, the reading of a model config's
#: layer types (engine and planner agree on it), and the version.
CONTRACT = ("agent", "agent.schema", "agent.clock", "agent.errors", "agent.intervals",
            "agent.layer_types")
#: Reading a run store (the writer is the telemetry plane's).
READER = ("agent.runstore.reader", "agent.runstore.layout")
TELEMETRY = ("agent.telemetry",)


def _within(target: str, prefixes: tuple[str, ...], *, exact: tuple[str, ...] = ()) -> bool:
    return target in exact or any(target == p or target.startswith(p + ".") for p in prefixes)


def allowed(source: str, target: str) -> bool:
    """Whether module `source` may import module `target` (both inside the project)."""
    src, dst = source.split(".")[0], target.split(".")[0]
    if src == dst:
        if src == "agent" and _within(source, CONTRACT[1:]):
            # The contract is the floor of the floor: it imports only itself.
            return target in CONTRACT
        return True
    if src == "kvscope":
        return True
    if src == "collectors":
        return dst == "agent"
    if src == "instrumented_engine":
        return target in CONTRACT or _within(target, TELEMETRY)
    if src == "analyzers":
        return target in CONTRACT or target in READER
    if src == "dashboard":
        return dst == "analyzers" or target in CONTRACT or target in READER
    return False  # agent imports nothing else of the project


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # importing module
    target: str  # imported module (for `from m import name`: m.name when that is a module)
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(source: str, is_package: bool, level: int, module: str | None) -> str:
    base = source.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([module] if module else [])])


def imports_of(root: Path, path: Path, modules: set[str]) -> list[Import]:
    """Every project import in `path` (a module under `root`)."""
    source = module_name(root, path)
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = (_resolve(source, is_package, node.level, node.module) if node.level
                   else node.module or "")
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.append((sub if sub in modules else mod, node.lineno))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if (name in ("import_module", "__import__") and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                found.append((node.args[0].value, node.lineno))
    unique = dict.fromkeys((t, line) for t, line in found if t.split(".")[0] in PACKAGES)
    return [Import(source, t, path, line) for t, line in unique]


def project_imports(root: Path) -> list[Import]:
    files = [p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")]
    modules = {module_name(root, p) for p in files}
    return [imp for p in sorted(files) for imp in imports_of(root, p, modules)]


def violations(root: Path) -> list[str]:
    """Imports against the layer edges, and package-level cycles."""
    bad = [str(i) for i in project_imports(root) if not allowed(i.source, i.target)]
    graph: dict[str, set[str]] = defaultdict(set)
    for i in project_imports(root):
        a, b = i.source.split(".")[0], i.target.split(".")[0]
        if a != b:
            graph[a].add(b)
    bad += [f"package cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    out: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                out.append([*stack[stack.index(nxt):], node, nxt] if nxt in stack
                           else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    return out


def test_every_import_follows_the_layers() -> None:
    bad = violations(REPO)
    assert bad == [], "layer violations:\n" + "\n".join(bad)


def test_the_walk_sees_the_imports_it_must() -> None:
    # The check is only as good as its walk: it must see the imports inside function bodies
    # (the CLI's commands load their dependencies there) in the real tree.
    imps = project_imports(REPO)
    assert any(i.source == "kvscope.commands.run" and i.target == "kvscope.session"
               for i in imps)


def _tree(tmp: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    for pkg in PACKAGES:
        (tmp / pkg).mkdir(exist_ok=True)
        (tmp / pkg / "__init__.py").touch()
    return tmp


def test_a_wrong_import_fails_the_check(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "agent/schema.py": "X = 1\n",
        "agent/runstore/__init__.py": "",
        "agent/runstore/reader.py": "from agent.schema import X\n",
        "analyzers/ok.py": "from agent.runstore.reader import X\n",
        # the engine reaching into the exporters, inside a function body
        "instrumented_engine/bad.py": "def f():\n    from agent.exporters import prometheus\n",
        # the bottom layer importing the top one through importlib
        "agent/late.py": "import importlib\nM = importlib.import_module('kvscope.cli')\n",
        # a relative import out of the contract into the telemetry plane
        "agent/clock.py": "from .telemetry import recorder\n",
        "agent/telemetry/__init__.py": "",
        "agent/telemetry/recorder.py": "",
    })
    got = violations(root)
    assert any("instrumented_engine.bad imports agent.exporters" in v for v in got), got
    assert any("agent.late imports kvscope.cli" in v for v in got), got
    assert any("agent.clock imports agent.telemetry.recorder" in v for v in got), got
    assert not any("analyzers.ok" in v for v in got), got
    assert any(v.startswith("package cycle:") for v in got) is False


def test_a_package_cycle_fails_the_check(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "dashboard/page.py": "import analyzers.x\n",
        "analyzers/x.py": "import dashboard.page\n",
    })
    got = violations(root)
    assert "package cycle: analyzers -> dashboard -> analyzers" in got, got
    assert any("analyzers.x imports dashboard.page" in v for v in got), got
