"""The project stands alone: no tracked file points at a folder outside the repository
(e.g. the developers' ../shared/ specs, which no user's clone has)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"(\.\./)+shared/")


def test_no_reference_to_paths_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    hits = []
    for name in files:
        path = REPO / name
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".toml", ".txt"} or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and name != "tests/unit/test_no_outside_paths.py":
                hits.append(f"{name}:{n}: {line.strip()}")
    assert hits == []
