"""No two agentrl modules import each other (imports run one way), lazy imports inside functions
included (a lazy import hides a cycle from import-linter's layers but is still one); `if TYPE_CHECKING:` imports
do not count (they never run)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_names() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "agentrl").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for node in ast.walk(branch)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(
                    package[: len(package) - node.level + 1] + ([node.module] if node.module else [])
                )
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            found |= submodules
            if len(submodules) < len(node.names):  # names defined in `base` itself
                found.add(base)
    return {m for m in found if m in modules and m != name}


def test_no_two_modules_import_each_other():
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["agentrl.runner.trainer"], "the scan found no imports: it is broken, not the tree clean"
    pairs = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph[b]})
    assert not pairs, f"modules importing each other: {pairs}"
