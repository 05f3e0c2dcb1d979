"""Same inputs, same bytes: polars `group_by` returns its groups in a different order in every
process (it hashes with its own random state, not PYTHONHASHSEED), so a float sum taken in that
order changes in the last bit from one run to the next (seen in ampd's attainment.csv). Every
`group_by` in `stages/` must fix its order in the same statement (`maintain_order=True`, or a
`.sort(...)` after it), or be one of the audited sites below, where the order reaches no output
(the result is sorted in a later statement, read into a dict, or only counted)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (path, first line of the statement, stripped): why its group order cannot reach an output.
AUDITED = {
    ("stages/agents/trajectories.py", 'per = steps.group_by("episode_id").agg('):
        "integer step counts per episode, checked for a bound, never written in group order",
    ("stages/ddr/databases.py", 'per = ev.group_by("seed", "entity").len()["len"]'):
        "integer counts; only their min/max are used",
    ("stages/gift/compare.py", 'agg = rows.group_by("seed", "image_id").agg('):
        "sorted by (seed, image_id) in the next statement",
    ("stages/gift/compare.py",
     'rates = pope.filter(pl.col("arm") == arm).group_by("seed").agg(pl.col("pred_yes").mean())'):
        "a yes/no test over all groups (all rates 0 or 1): order-free",
    ("stages/plugmem/memory.py", 'by_sample = {k: g for k, g in questions.group_by("seed", "sample")}'):
        "a dict keyed by group, read by key",
    ("stages/proofverify/candidates.py", 'per = df.group_by("problem_id").agg('):
        "means of booleans (exact integer sums), taken over all groups: order-free",
    ("stages/proofverify/compare.py", 'per = (sel.join(lab, on="selected_id", how="left")'):
        "means of 0/1 and integer values (exact sums); the pivot is sorted by problem_id",
    ("stages/racer/outcomes.py",
     'by = every.group_by("difficulty").agg(pl.col(f"{judge}_correct").mean().alias("a"),'):
        "iterated as by.sort(\"difficulty\") in the next statement",
    ("stages/ampd/compare.py", 'sorted(r.group_by("load_index"), key=lambda kv: kv[0][0])'):
        "the groups are sorted by key in the same expression",
    ("stages/racer/compare.py", 'frame.group_by(["method", "budget", "split"])'):
        "each group writes its own metric keys; the details JSON is written with sorted keys",
    ("stages/same/compare.py", 'agg = diag.group_by("arm", "seed", "order").agg(pl.col("acc").mean())'):
        "read into a dict keyed by (arm, seed, order)",
    ("stages/same/compare.py", 'final.group_by("arm", "task").agg(pl.col("acc").mean()).iter_rows()'):
        "each group writes its own metric key; the details JSON is written with sorted keys",
    ("stages/same/compare.py",
     'm = matrix.filter(pl.col("arm") == arm).group_by("after", "position").agg('):
        "each group fills its own cell of the plotted grid",
    ("stages/refine_prover/compare.py",
     'agg = part.group_by("problem").agg(pl.col(col).cast(pl.Float64).mean())'):
        "read into a dict keyed by problem; pairs are taken over sorted keys",
}

_BLOCKS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.AsyncFor, ast.While,
           ast.If, ast.With, ast.AsyncWith, ast.Try, ast.Match)


def _header(block: ast.stmt) -> ast.AST | None:
    """The expression a block statement evaluates before its body, if one can hold a group_by."""
    if isinstance(block, (ast.For, ast.AsyncFor)):
        return block.iter
    if isinstance(block, (ast.If, ast.While)):
        return block.test
    if isinstance(block, (ast.With, ast.AsyncWith)) and block.items:
        return block.items[0].context_expr
    return None


def unordered_group_bys(source: str) -> list[tuple[int, str]]:
    """(line, first line of the statement) of each `.group_by(...)` whose statement neither passes
    `maintain_order=...` to it nor calls `.sort(` after it."""
    found = []
    lines = source.splitlines(keepends=True)

    def text(node: ast.AST) -> str:  # ast.get_source_segment re-splits the source every call
        first, last = node.lineno - 1, node.end_lineno - 1
        if first == last:
            return lines[first][node.col_offset:node.end_col_offset]
        return "".join([lines[first][node.col_offset:], *lines[first + 1:last],
                        lines[last][:node.end_col_offset]])

    for stmt in ast.walk(ast.parse(source)):
        if not isinstance(stmt, ast.stmt):
            continue
        if isinstance(stmt, _BLOCKS):  # its body's statements are visited one by one; here
            stmt = _header(stmt)       # only what its header evaluates (a for's iterable, ...)
            if stmt is None:
                continue
        calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr == "group_by"
                 and not any(k.arg == "maintain_order" for k in n.keywords)]
        if not calls:
            continue
        segment = text(stmt)
        for node in calls:
            call = text(node)
            after = segment[segment.find(call) + len(call):] if call in segment else segment
            if ".sort(" not in after:
                found.append((node.lineno, segment.splitlines()[0].strip()))
    return found


def test_the_check_flags_an_unordered_group_by_and_accepts_ordered_ones():
    bad = 'out = df.group_by("seed").agg(pl.col("x").sum())\n'
    assert unordered_group_bys(bad) == [(1, bad.strip())]
    nested = 'def f(df):\n    if True:\n        return df.group_by("a").len()\n'
    assert [line for line, _ in unordered_group_bys(nested)] == [3]
    loop = 'for k, v in df.group_by("a").agg(pl.col("x").sum()).iter_rows():\n    out[k] = v\n'
    assert unordered_group_bys(loop) == [(1, 'df.group_by("a").agg(pl.col("x").sum()).iter_rows()')]
    for good in ('out = df.group_by("seed", maintain_order=True).agg(pl.col("x").sum())\n',
                 'out = df.group_by("seed").agg(pl.col("x").sum()).sort("seed")\n',
                 'out = (df.group_by("seed")\n       .agg(pl.col("x").sum())\n       .sort("seed"))\n'):
        assert unordered_group_bys(good) == [], good
    # a sort before the group_by does not order its groups
    assert len(unordered_group_bys('out = df.sort("a").group_by("a").len()\n')) == 1


def test_every_group_by_in_stages_has_a_fixed_order_or_an_audited_reason():
    seen, new = set(), []
    for path in sorted((REPO / "stages").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for line, first in unordered_group_bys(path.read_text()):
            if (rel, first) in AUDITED:
                seen.add((rel, first))
            else:
                new.append(f"{rel}:{line}: {first}")
    assert not new, ("group_by without a fixed group order (add maintain_order=True or a .sort() "
                     "in the same statement, or audit it here with the reason its order cannot "
                     "reach an output):\n" + "\n".join(new))
    stale = sorted(set(AUDITED) - seen)
    assert not stale, f"audited sites no longer in the code (drop them): {stale}"
