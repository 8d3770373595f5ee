"""tests/ is a package: every test and support module is imported as `tests.x` (`tests.reliability.x`), never by
a bare name that resolves only while pytest happens to put tests/ on sys.path. The same holds for the
`module:function` plugin specs the tests hand to agentrl and for bench/ scripts that borrow test helpers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# a separate distribution that the plugin tests install or put on PYTHONPATH themselves: imported by its own name
OWN_DISTRIBUTIONS = {TESTS / "plugin_pkg"}


def package_dirs() -> list[Path]:
    """tests/ and every folder under it that holds Python files, outside the plugin distributions."""
    dirs = {p.parent for p in TESTS.rglob("*.py")}
    return sorted(d for d in dirs if not any(d == o or o in d.parents for o in OWN_DISTRIBUTIONS))


def bare_names(folder: Path) -> set[str]:
    """The names that would import a module of `folder` were `folder` on sys.path: its modules and packages."""
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    return names | {d.name for d in folder.iterdir() if (d / "__init__.py").is_file()}


def scanned_files() -> list[Path]:
    files = [p for d in package_dirs() for p in d.glob("*.py")]
    return sorted(files + list((ROOT / "bench").rglob("*.py")))


def bare_uses(path: Path, names: set[str]) -> list[str]:
    """`import x`, `from x import y` and "x:function" plugin specs where x (its first part) is in `names`."""
    spec = re.compile(rf"^({'|'.join(map(re.escape, sorted(names)))})(\.\w+)*:\w*$")
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and spec.match(node.value):
            modules = [node.value.split(":")[0]]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {m}" for m in modules if m.split(".")[0] in names]
    return found


def test_every_folder_of_tests_is_a_package():
    assert [str(d.relative_to(ROOT)) for d in package_dirs() if not (d / "__init__.py").is_file()] == []


def test_no_module_of_tests_is_imported_by_a_bare_name():
    names = bare_names(TESTS)
    assert {"run_support", "gen_support", "megatron_helpers", "reliability", "test_lora"} <= names
    found = []
    for path in scanned_files():
        # a module also sees its own folder's modules by bare name when that folder is on sys.path
        found += bare_uses(path, names | (bare_names(path.parent) if TESTS in path.parents else set()))
    assert found == [], "import these as tests.<module> (tests.reliability.<module>):\n" + "\n".join(found)


def test_pytest_imports_test_modules_as_the_tests_package():
    assert __name__ == "tests.test_test_layout"
    from tests import run_support

    assert Path(run_support.__file__).parent == TESTS
