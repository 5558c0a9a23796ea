"""The house rules of issue 44 that hold so far, read from the source (ast): no import cycle
between files (imports inside functions count), no file over 500 lines and no function over
80 in the package."""
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"rbcompile": ROOT / "rbcompile", "rbcompile.runtime": ROOT / "runtime",
            "rbcompile.passes": ROOT / "passes", "rbcompile.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    """Module name -> file, as installed (runtime/ is rbcompile.runtime, and so on)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [part for part in path.relative_to(folder).with_suffix("").parts
                     if part != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, anywhere in it."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = name.split(".")
            if node.level:
                keep = len(base) - node.level + (path.name == "__init__.py")
                base = base[:keep] + ([node.module] if node.module else [])
                module = ".".join(base)
            else:
                module = node.module or ""
            candidates = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or not (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in list(edges):
        if node not in index:
            visit(node)
    return groups


def test_no_import_cycle_between_files():
    known = modules()
    edges = defaultdict(set, {name: imported(name, path, known) for name, path in known.items()})
    assert cycles(edges) == []


def test_the_cycle_finder_finds_one():
    edges = defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycles(edges) == [["a", "b", "c"]]


def test_no_file_over_500_lines_and_no_function_over_80():
    long_files, long_functions = [], []
    for name, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 500:
            long_files.append(name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{name}.{node.name}")
    assert long_files == [] and long_functions == []
