"""Structure checks over the packages' sources (packages/*/src), run by `./dev.sh test` and `nox -s lint`:

    python tools/code_checks.py cycles       # no import cycle between modules
    python tools/code_checks.py complexity   # no function above cyclomatic complexity 20 (radon)
    python tools/code_checks.py              # both

`cycles` builds the module graph from every import statement (top level, inside functions, and under
`if TYPE_CHECKING:` alike: a module that needs another only for its types still depends on it) and
reports each strongly connected set of modules with the imports that close it. `from pkg import name`
counts as importing `pkg.name` when that is a module, else `pkg` itself (its `__init__`). Cython
modules (.pyx) count as modules. Stdlib only, so it also runs without the venv.

`complexity` needs radon (pinned in dev.sh and the noxfile). Exits 1 and prints every finding; an
exemption whose branch has landed (EXEMPT_CYCLES, EXEMPT_COMPLEXITY) is printed as a note only, so
the check passes the moment that branch merges.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_COMPLEXITY = 20

# Cycles still being removed on another branch, by the modules they join. Remove an entry when its
# branch lands: the check then passes with or without it, and prints a note while a stale entry stays.
EXEMPT_CYCLES: Mapping[frozenset[str], str] = {
    frozenset({"deepinfer.kernels.triton_ops.moe", "deepinfer.kernels.triton_ops.moe_grouped",
               "deepinfer.kernels.triton_ops.moe_grouped_kernels"}): "branch e29 rewrites these kernels",
}
# Files whose functions may exceed MAX_COMPLEXITY for now, with the branch that splits them (a note
# is printed once such a file is back under the limit, so that its entry is removed).
EXEMPT_COMPLEXITY: Mapping[str, str] = {
    "packages/deepinfer-engine/src/deepinfer/engine/llm_engine.py": "branch d30s (issue #30: the Step protocol)",
    "packages/deepinfer-engine/src/deepinfer/engine/model_runner.py": "branch d30s (issue #30: the Step protocol)",
    "packages/deepinfer-engine/src/deepinfer/engine/sampling_stage.py": "branch d30s (issue #30: the Step protocol)",
}


@dataclass(frozen=True, slots=True)
class Module:
    name: str        # dotted, e.g. deepinfer.engine.serve.app
    path: Path
    is_package: bool


def find_modules(root: Path = ROOT) -> dict[str, Module]:
    """Every module under root/packages/*/src by dotted name (.py, and .pyx with no .py twin)."""
    modules: dict[str, Module] = {}
    for src in sorted((root / "packages").glob("*/src")):
        for path in sorted([*src.rglob("*.py"), *src.rglob("*.pyx")]):
            parts = list(path.relative_to(src).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            if path.suffix == ".py" or name not in modules:
                modules[name] = Module(name, path, is_package)
    return modules


def _imported(module: Module, node: ast.Import | ast.ImportFrom, known: Mapping[str, Module]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name in known)
        return
    if node.level:
        base = module.name.split(".")[: None if module.is_package else -1]
        base = base[: len(base) - (node.level - 1)]
        origin = ".".join([*base, *([node.module] if node.module else [])])
    else:
        origin = node.module or ""
    for alias in node.names:
        if f"{origin}.{alias.name}" in known:
            yield f"{origin}.{alias.name}"
        elif origin in known:
            yield origin


def import_graph(modules: Mapping[str, Module]) -> dict[str, dict[str, int]]:
    """{module: {imported module: line of its first import}}, within `modules` only."""
    graph: dict[str, dict[str, int]] = {}
    for name, module in modules.items():
        edges: dict[str, int] = {}
        if module.path.suffix == ".py":
            for node in ast.walk(ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    for target in _imported(module, node, modules):
                        edges.setdefault(target, node.lineno)
        edges.pop(name, None)
        graph[name] = edges
    return graph


def cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        found.append(sorted(members))
    return found


def check_cycles(root: Path = ROOT) -> list[str]:
    """One message per import cycle not in EXEMPT_CYCLES, with the imports that close it."""
    modules = find_modules(root)
    graph = import_graph(modules)
    problems = []
    for members in cycles(graph):
        key = frozenset(members)
        if key in EXEMPT_CYCLES:
            continue
        lines = [f"import cycle between {len(members)} modules:"]
        for name in members:
            rel = modules[name].path.relative_to(root)
            lines += [f"    {rel}:{line} imports {target}" for target, line in sorted(graph[name].items())
                      if target in key]
        problems.append("\n".join(lines))
    return problems


def stale_exemptions(root: Path = ROOT, limit: int = MAX_COMPLEXITY) -> list[str]:
    """Exemptions no longer needed (their branch landed): notes, not failures."""
    from radon.complexity import cc_visit

    found = {frozenset(members) for members in cycles(import_graph(find_modules(root)))}
    notes = [f"EXEMPT_CYCLES lists {sorted(key)} ({why}), no longer a cycle: remove the entry"
             for key, why in EXEMPT_CYCLES.items() if key not in found]
    for rel, why in EXEMPT_COMPLEXITY.items():
        path = root / rel
        if path.exists() and all(block.complexity <= limit
                                 for block in _functions(cc_visit(path.read_text(encoding="utf-8")))):
            notes.append(f"EXEMPT_COMPLEXITY lists {rel} ({why}), now within {limit}: remove the entry")
    return notes


def _functions(blocks: list) -> Iterator:
    """radon's functions and methods (classes count through their methods, which radon lists too),
    with the functions nested in them."""
    for block in blocks:
        if not hasattr(block, "methods"):
            yield block
            yield from _functions(block.closures)


def check_complexity(root: Path = ROOT, limit: int = MAX_COMPLEXITY) -> list[str]:
    """One message per function or method above `limit` (radon's cyclomatic complexity) outside
    EXEMPT_COMPLEXITY's files."""
    from radon.complexity import cc_visit

    problems = []
    for module in find_modules(root).values():
        if module.path.suffix != ".py":
            continue
        rel = str(module.path.relative_to(root))
        over = [block for block in _functions(cc_visit(module.path.read_text(encoding="utf-8")))
                if block.complexity > limit]
        if rel in EXEMPT_COMPLEXITY:
            continue
        problems += [f"{rel}:{block.lineno}: {block.fullname} has cyclomatic complexity {block.complexity} "
                     f"(at most {limit}): split it" for block in over]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checks", nargs="*", help="cycles and/or complexity (default: both)")
    checks = parser.parse_args(argv).checks or ["cycles", "complexity"]
    unknown = sorted(set(checks) - {"cycles", "complexity"})
    if unknown:
        parser.error(f"unknown check(s) {unknown}: cycles, complexity")
    problems = []
    if "cycles" in checks:
        problems += check_cycles()
    if "complexity" in checks:
        problems += check_complexity()
    for problem in problems:
        print(problem)
    if "complexity" in checks:     # radon is needed for the complexity half of the notes
        for note in stale_exemptions():
            print(f"note: {note}")
    print(f"code_checks ({', '.join(checks)}): {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
