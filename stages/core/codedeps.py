"""Code deps that cannot drift: every stage's `dvc.yaml` deps list the project modules it imports.

DVC reruns a stage only when a declared dependency changes. A stage whose module imports
`stages/tasks/arith.py` without declaring it would keep its cached result after the verifier
changed, so a committed number could silently come from other code. This module follows each
stage module's imports transitively (statically, with `ast`: module-level and function-level
imports, relative imports, `from pkg import module`; `if TYPE_CHECKING:` blocks skipped) and

- `required(module)`: the project files a stage's code depends on;
- `check(root)`: per dvc.yaml and stage, the files missing from its deps and the code deps that
  are declared but not imported (both must be empty: the lists are generated, not hand-kept);
- `write(root)`: rewrites the code entries of every stage's deps in place (other deps, comments
  and order of the rest untouched). `paperline deps --write` calls it; `paperline deps` checks.

The contract's plumbing is left out (CONTRACT below): parsing params, the MLflow child run,
atomic renames, data checks, storage and the worker pool (`pool.py`: which process runs a job,
never what the job returns) decide whether and where a stage runs, never what it computes;
listing them would rerun every stage of every pipeline on a logging change. Anything
that computes a result (including `stages/core/stats.py`, the claim rule of every compare) is
a dependency like any other module.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

# Plumbing of the stage contract (see module docstring): not code deps of any stage.
CONTRACT = frozenset({
    "stages/__init__.py",
    "stages/__main__.py",
    "stages/registry.py",
    "stages/core/__init__.py",
    "stages/core/checks.py",
    "stages/core/codedeps.py",
    "stages/core/config.py",
    "stages/core/context.py",
    "stages/core/forkserver.py",
    "stages/core/io.py",
    "stages/core/pool.py",
    "stages/core/runner.py",
    "stages/core/storage.py",
    "stages/core/tracking.py",
})

_STAGE_HEADER = re.compile(r"^  ([A-Za-z_][\w-]*):\s*(#.*)?$")
_CMD = re.compile(r"python -m stages (\S+) (\S+)")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom node, skipping the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def module_file(root: Path, module: str) -> Path | None:
    """The file of a dotted module under `root` (a package's __init__.py), or None."""
    base = root.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _module_of(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def direct_imports(root: Path, path: Path) -> set[str]:
    """Dotted names of the project modules (`stages.*`) that the file at `path` imports."""
    stat = path.stat()
    return set(_direct_imports(root, path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4096)
def _direct_imports(root: Path, path: Path, _mtime: int, _size: int) -> frozenset[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    this = _module_of(root, path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
            found.update(n for n in names if n == "stages" or n.startswith("stages."))
            continue
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if not (base == "stages" or base.startswith("stages.")):
            continue
        found.add(base)
        for alias in node.names:  # `from stages.tasks import arith`: arith is a module
            if module_file(root, f"{base}.{alias.name}") is not None:
                found.add(f"{base}.{alias.name}")
    return frozenset(found)


def _with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _is_empty(path: Path) -> bool:
    """A file with no statement but a docstring cannot change what a stage computes."""
    stat = path.stat()
    return _is_empty_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _is_empty_cached(path: Path, _mtime: int, _size: int) -> bool:
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return not body


def required(root: Path, module: str) -> list[str]:
    """Repo-relative files a stage module depends on, transitively, contract plumbing excluded."""
    seen: set[str] = set()
    files: set[str] = set()
    todo = [module]
    while todo:
        mod = todo.pop()
        for name in _with_parents(mod):  # importing a.b.c runs a/__init__ and a/b/__init__
            if name in seen:
                continue
            seen.add(name)
            path = module_file(root, name)
            if path is None:
                continue
            rel = path.relative_to(root).as_posix()
            if rel in CONTRACT:
                continue
            if not _is_empty(path):
                files.add(rel)
            todo.extend(direct_imports(root, path))
    return sorted(files)


def _dvcfiles(root: Path) -> list[Path]:
    found = [root / "dvc.yaml"]
    found += sorted((root / "pipelines").glob("*/dvc.yaml"))
    return [p for p in found if p.is_file()]


def _stage_blocks(lines: list[str]) -> dict[str, tuple[int, int]]:
    """stage name -> (first line, end line) of its block under `stages:`."""
    blocks: dict[str, tuple[int, int]] = {}
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == "stages:"), None)
    if start is None:
        return blocks
    current, first = None, 0
    for i in range(start + 1, len(lines) + 1):
        line = lines[i] if i < len(lines) else ""
        m = _STAGE_HEADER.match(line) if i < len(lines) else None
        top = i < len(lines) and line[:1] not in ("", " ", "#", "\n")
        if m or top or i == len(lines):
            if current is not None:
                blocks[current] = (first, i)
            current, first = (m.group(1), i) if m else (None, i)
            if top:
                break
    return blocks


def _code_dep(entry: str, wdir: Path, root: Path) -> str | None:
    """The repo-relative path of a deps entry if it is project code (under stages/), else None."""
    if "${" in entry:
        return None
    rel = Path(entry)
    try:
        path = (wdir / rel).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return None
    return path if path == "stages" or path.startswith("stages/") else None


def _plan(root: Path, dvcfile: Path):
    """Per stage: (block lines, deps line index, [(line index, entry)], module)."""
    lines = dvcfile.read_text().splitlines(keepends=True)
    plans = {}
    for stage, (lo, hi) in _stage_blocks(lines).items():
        cmd = next((_CMD.search(ln) for ln in lines[lo:hi] if _CMD.search(ln)), None)
        if cmd is None:
            continue
        from stages.registry import STAGES

        module = STAGES.get(cmd.group(1), {}).get(cmd.group(2))
        deps_at = next((i for i in range(lo, hi) if lines[i].rstrip() == "    deps:"), None)
        entries = []
        if deps_at is not None:
            i = deps_at + 1
            while i < hi and lines[i].startswith("      - "):
                entries.append((i, lines[i][len("      - "):].strip()))
                i += 1
        plans[stage] = (deps_at, entries, module, lo)
    return lines, plans


def check(root: Path) -> dict[str, dict[str, dict[str, list[str]]]]:
    """{dvc.yaml: {stage: {"missing": [...], "extra": [...]}}} for stages whose code deps differ
    from the imports; empty when every stage is covered exactly."""
    problems: dict[str, dict[str, dict[str, list[str]]]] = {}
    for dvcfile in _dvcfiles(root):
        _, plans = _plan(root, dvcfile)
        for stage, (_, entries, module, _) in plans.items():
            if module is None:
                continue
            declared = {p for _, e in entries if (p := _code_dep(e, dvcfile.parent, root))}
            need = set(required(root, module))
            covered = {f for f in need if any(f == d or f.startswith(d + "/") for d in declared)}
            missing = sorted(need - covered)
            extra = sorted(declared - need)
            if missing or extra:
                key = dvcfile.relative_to(root).as_posix()
                problems.setdefault(key, {})[stage] = {"missing": missing, "extra": extra}
    return problems


def write(root: Path) -> list[str]:
    """Rewrite every stage's code deps to exactly its imports; returns the dvc.yaml files changed."""
    changed = []
    for dvcfile in _dvcfiles(root):
        lines, plans = _plan(root, dvcfile)
        edits = []  # (first line, end line, replacement lines), applied bottom-up
        for stage, (deps_at, entries, module, lo) in plans.items():
            if module is None:
                continue
            rel_prefix = Path(*[".."] * len(dvcfile.parent.relative_to(root).parts))
            code = [f"      - {(rel_prefix / f).as_posix()}\n" for f in required(root, module)]
            rest = [f"      - {e}\n" for _, e in entries if _code_dep(e, dvcfile.parent, root) is None]
            if deps_at is None:
                at = next(i for i in range(lo, len(lines)) if lines[i].lstrip().startswith("cmd:"))
                edits.append((at + 1, at + 1, ["    deps:\n"] + code + rest))
            else:
                end = entries[-1][0] + 1 if entries else deps_at + 1
                edits.append((deps_at + 1, end, code + rest))
        new = list(lines)
        for lo, hi, repl in sorted(edits, reverse=True):
            new[lo:hi] = repl
        if new != lines:
            dvcfile.write_text("".join(new))
            changed.append(dvcfile.relative_to(root).as_posix())
    return changed


# --- the import rule ---------------------------------------------------------------------------
# A paper's package (`stages/<slug>/`, one per pipeline) may import the shared packages and
# itself, never another paper; shared packages (core, models, tasks, evaluate, the training
# engines, and family engines added later) never import a paper. So one paper's change can only
# rerun that paper's stages, and the next paper builds on engines, not on a neighbour's code.


def paper_packages(root: Path) -> set[str]:
    """Names of the paper packages: every pipeline of the registry with a `stages/<package>/`
    (the package is the slug, or `registry.PACKAGES[slug]` where the slug names something else:
    pipeline `core` lives in `stages/core_align`, `stages/core` being the contract)."""
    from stages.registry import PACKAGES, SHARED, STAGES

    names = {PACKAGES.get(slug, slug) for slug in STAGES if slug not in SHARED}
    return {name for name in names if (root / "stages" / name).is_dir()}


def import_rule_violations(root: Path) -> list[str]:
    """'<file>: imports <module> (<why>)' for every import that breaks the rule above."""
    papers = paper_packages(root)
    found = []
    for path in sorted((root / "stages").rglob("*.py")):
        rel = path.relative_to(root)
        owner = rel.parts[1] if len(rel.parts) > 2 else None  # stages/<owner>/...
        mods = direct_imports(root, path)
        for mod in sorted(mods):
            if any(other.startswith(mod + ".") for other in mods):
                continue  # `from stages.hsir import hsir`: name the module, not its package too
            parts = mod.split(".")
            target = parts[1] if len(parts) > 1 else None
            if target not in papers or target == owner:
                continue
            why = (f"paper {owner!r} imports paper {target!r}" if owner in papers
                   else "shared code imports a paper")
            found.append(f"{rel.as_posix()}: imports {mod} ({why})")
    return found
