"""The structure figures of issue 32, from the sources alone (ast; nothing is imported or run).

    python tools/arch_metrics.py            # a summary
    python tools/arch_metrics.py --cycles   # and every import circle, module by module

Figures: modules at the daemon package's top level; import circles (strongly connected
components of more than one module) at run time and counting `if TYPE_CHECKING:` imports;
the largest class, the widest protocol and the widest signatures (parameters other than
self/cls, *args and **kwargs counted); the depth of the import graph (the longest chain of
modules, and of packages, circles collapsed) and the imports that point up the declared layer order
(tests/layers.py, read from there so the figure and the rule agree).
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("client", "daemon")


@dataclass
class Graph:
    """Module name -> source path, and the internal imports of each module."""

    paths: dict[str, Path] = field(default_factory=dict)
    runtime: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))
    type_only: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))

    def edges(self, with_type_only: bool) -> dict[str, set[str]]:
        out = {m: set(self.runtime[m]) for m in self.paths}
        if with_type_only:
            for m in self.paths:
                out[m] |= self.type_only[m]
        return out


def module_graph(repo: Path = REPO) -> Graph:
    """Every hand-written module under client/ and daemon/ (generated stubs left out)."""
    graph = Graph()
    for base in ROOTS:
        for path in sorted((repo / base).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            name = ".".join(path.relative_to(repo / base).with_suffix("").parts).removesuffix(".__init__")
            graph.paths[name] = path
    for name, path in graph.paths.items():
        tree = ast.parse(path.read_text())
        guarded = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for n in ast.walk(stmt)
        }
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in graph.paths else base for a in node.names]
            for target in targets:
                while target and target not in graph.paths:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    (graph.type_only if id(node) in guarded else graph.runtime)[name].add(target)
    return graph


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in edges:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int | None:
    """Index of the layer (0 = top) whose longest matching prefix names `module`."""
    best: tuple[int, int] | None = None
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    return None if best is None else best[0]


def upward_imports(graph: Graph, layers: list[tuple[str, ...]]) -> list[str]:
    """`a -> b` for each import (type-only included) from a lower layer to a higher one."""
    out = []
    for a, targets in graph.edges(with_type_only=True).items():
        la = layer_of(a, layers)
        for b in sorted(targets):
            lb = layer_of(b, layers)
            if la is not None and lb is not None and lb < la:
                out.append(f"{a} -> {b}")
    return sorted(out)


def depth(graph: Graph, group: int = 3) -> int:
    """Longest chain of packages (module names cut to `group` parts, circles collapsed)."""
    def cut(m: str) -> str:
        return ".".join(m.split(".")[:group])

    edges: dict[str, set[str]] = collections.defaultdict(set)
    for a, targets in graph.edges(with_type_only=True).items():
        edges[cut(a)] |= {cut(b) for b in targets if cut(b) != cut(a)}
    nodes = set(edges) | {b for t in edges.values() for b in t}
    for n in nodes:
        edges.setdefault(n, set())
    component = {m: i for i, c in enumerate(circles(edges)) for m in c}
    rep = {n: f"#{component[n]}" if n in component else n for n in nodes}
    dag: dict[str, set[str]] = collections.defaultdict(set)
    for a in nodes:
        dag[rep[a]] |= {rep[b] for b in edges[a] if rep[b] != rep[a]}
    memo: dict[str, int] = {}

    def longest(n: str) -> int:
        if n not in memo:
            memo[n] = 1 + max((longest(c) for c in dag.get(n, ())), default=0)
        return memo[n]

    sys.setrecursionlimit(10_000)
    return max(longest(n) for n in set(rep.values()))


def largest_classes(graph: Graph, top: int = 3) -> tuple[list[tuple[int, int, str]], list[tuple[int, str]]]:
    """(lines, methods, where) of the biggest classes; (methods, where) of the widest Protocols."""
    classes, protocols = [], []
    for path in graph.paths.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.end_lineno is None:
                continue
            methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
            where = f"{path.relative_to(REPO)}:{node.lineno} {node.name}"
            classes.append((node.end_lineno - node.lineno + 1, methods, where))
            if any(ast.unparse(b).endswith("Protocol") for b in node.bases):
                protocols.append((methods, where))
    return sorted(classes, reverse=True)[:top], sorted(protocols, reverse=True)[:top]


def widest_functions(graph: Graph, top: int = 8) -> list[tuple[int, str]]:
    """(parameters, where) of the functions and methods with the most parameters (self and cls
    left out; *args and **kwargs count one each)."""
    found = []
    for path in graph.paths.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            count = len([n for n in names if n not in ("self", "cls")]) + (a.vararg is not None) + (a.kwarg is not None)
            found.append((count, f"{path.relative_to(REPO)}:{node.lineno} {node.name}"))
    return sorted(found, key=lambda f: (-f[0], f[1]))[:top]


def _layers() -> list[tuple[str, ...]]:
    sys.path.insert(0, str(REPO / "tests"))
    from layers import DAEMON_LAYERS, LAYERS  # tests/layers.py: the declared order, shared with test_hygiene

    return [*DAEMON_LAYERS, *LAYERS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", action="store_true", help="print every circle")
    args = parser.parse_args()
    graph = module_graph()
    daemon_top = sorted(m for m in graph.paths if m.startswith("ckptd.daemon.") and m.count(".") == 2
                        and graph.paths[m].name != "__init__.py")
    runtime = circles(graph.edges(with_type_only=False))
    typed = circles(graph.edges(with_type_only=True))
    classes, protocols = largest_classes(graph)
    layers = _layers() if (REPO / "tests" / "layers.py").exists() else []
    up = upward_imports(graph, layers) if layers else []  # daemon and client-root orders apart: neither module set overlaps
    print(f"modules (hand-written): {len(graph.paths)}")
    print(f"daemon top-level modules: {len(daemon_top)}: {', '.join(m.rpartition('.')[2] for m in daemon_top)}")
    print(f"import circles at run time: {len(runtime)} (largest {max(map(len, runtime), default=0)} modules)")
    print(f"import circles counting TYPE_CHECKING: {len(typed)} (largest {max(map(len, typed), default=0)} modules)")
    print(f"import depth, circles collapsed: {depth(graph, group=99)} modules, {depth(graph)} packages (ckptd.daemon.X)")
    print(f"imports pointing up the layer order: {len(up)}")
    for line in up:
        print(f"  {line}")
    for lines, methods, where in classes:
        print(f"class: {where}: {lines} lines, {methods} methods")
    for methods, where in protocols:
        print(f"protocol: {where}: {methods} methods")
    for count, where in widest_functions(graph):
        print(f"signature: {where}: {count} parameters")
    if args.cycles:
        for c in typed:
            print("circle: " + " ".join(c))


if __name__ == "__main__":
    main()
