"""Write one named section of benchmarks/RESULTS.md, leaving the other sections alone."""

from __future__ import annotations

import datetime as dt
import platform
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(title: str, body: str) -> None:
    """Replace (or append) the `## <title>` section; stamps date and machine."""
    import os

    stamp = (f"_Measured {dt.datetime.now().strftime('%Y-%m-%d %H:%M')} on {platform.machine()}, "
             f"{os.cpu_count()} cores, Python {platform.python_version()}._\n\n")
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\nEvery figure below was produced by the script named in its section.\n"
    section = f"## {title}\n\n{stamp}{body.rstrip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(text.rstrip() + "\n")
    tmp.replace(RESULTS)
