"""The house rules of issue 44, read from the source (ast): imports go one way between the
rooms (docs/architecture.md), no import cycle between files (imports inside functions count),
no file over 500 lines and no function over 80 in the package."""
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
        if any(candidate in known for candidate in candidates[1:]):
            candidates = candidates[1:]   # `from package import module`: the modules only
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


# The rooms, lowest first: a module may import its own room and the rooms before it. The
# package root holds `__version__` and the API's lazy names (importing it loads no room).
ROOMS = (("shared", ("rbcompile", "rbcompile.errors", "rbcompile.progress", "rbcompile.child",
                     "rbcompile.calibration_data", "rbcompile.kernels")),
         ("artifact", ("rbcompile.artifact",)),
         ("engine", ("rbcompile.runtime.engine",)),
         ("control", ("rbcompile.runtime.control",)),
         ("serving", ("rbcompile.runtime", "rbcompile.runtime.serving")),
         ("passes", ("rbcompile.passes",)),
         ("compiler", ("rbcompile.compiler",)),
         ("frontend", ("rbcompile.frontend", "rbcompile.__main__")))


def room(module: str) -> int:
    """The rank of `module`'s room: the longest prefix that names one."""
    matches = [(len(prefix), rank) for rank, (_, prefixes) in enumerate(ROOMS)
               for prefix in prefixes if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no room"
    return max(matches)[1]


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


def test_imports_go_one_way_between_rooms():
    known = modules()
    backwards = [f"{name} -> {target} ({ROOMS[room(name)][0]} -> {ROOMS[room(target)][0]})"
                 for name, path in known.items() for target in imported(name, path, known)
                 if room(target) > room(name)]
    assert backwards == []


def test_a_backwards_import_is_found(tmp_path):
    artifact = tmp_path / "compiled.py"
    artifact.write_text("from rbcompile.runtime.engine.core import BatchEngine\n")
    known = {"rbcompile.artifact.compiled": artifact, "rbcompile.runtime.engine.core": artifact}
    target, = imported("rbcompile.artifact.compiled", artifact, known)
    assert room(target) > room("rbcompile.artifact.compiled")


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
