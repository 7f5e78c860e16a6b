"""The folders' dependency order, read from the import statements: errors.py and formats.py below everything,
models/ below the data and the plugins, configs/ only above them (`git grep -n "from configs" perf/ data/
models/ optim/` prints nothing)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"errors", "formats", "models", "optim", "data", "perf", "runtime", "configs"}
# what each part must never import
FORBIDDEN = {"errors": PARTS - {"errors"}, "formats": PARTS - {"errors", "formats"},
             "models": PARTS - {"errors", "formats", "models"}, "optim": {"configs", "data", "perf", "runtime"},
             "data": {"configs", "perf"}, "perf": {"configs"}}


def imported_parts(path: Path) -> set[str]:
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            parts |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts.add(node.module.split(".")[0])
    return parts & PARTS


def test_each_part_imports_only_the_parts_below_it():
    wrong = []
    for part, forbidden in FORBIDDEN.items():
        files = [ROOT / f"{part}.py"] if (ROOT / f"{part}.py").is_file() else sorted((ROOT / part).rglob("*.py"))
        assert files, part
        wrong += [f"{f.relative_to(ROOT)} imports {sorted(imported_parts(f) & forbidden)}" for f in files
                  if imported_parts(f) & forbidden]
    assert not wrong, wrong
