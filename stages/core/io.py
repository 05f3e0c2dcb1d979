"""Atomic writes: every output is written to a temporary sibling and renamed into place.

A stage killed mid-run therefore leaves either the previous output or nothing, never a
half-written file. `os.replace` is atomic on POSIX within one filesystem, which is why the
temporary path is a sibling of the target and not in /tmp. A stage whose `dvc repro` was killed
never renames: `proc.check_owner` refuses first (the stage itself is killed too, see proc.py).

Temporaries are named `.<name>.tmp-<pid>-<hex>`; those of a dead pid are removed at the start of
every `paperline repro` / `paperline run` and of every stage (`clean_stale_tmp_in`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

from . import proc

TMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-\w+$")


def _tmp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write into; on success it replaces `path`, on error it is removed.

    For directories (`is_dir=True`) the yielded path is an empty directory; the old directory, if
    any, is swapped out and deleted only after the new one is in place.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(target)
    if is_dir:
        tmp.mkdir()
    try:
        yield tmp
        proc.check_owner(str(target))  # an abandoned stage must not overwrite what dvc recorded
        if is_dir:
            old = None
            if target.exists():
                old = _tmp_sibling(target)
                os.replace(target, old)
            os.replace(tmp, target)
            if old is not None:
                _remove(old)
        else:
            if not tmp.exists():
                raise FileNotFoundError(f"nothing was written to {tmp} for {target}")
            os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(path: str | os.PathLike[str], data: Any) -> Path:
    return write_text(path, json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n")


# Wall times and throughputs are measurements of the machine, not results: they go to MLflow
# only, never into a file git tracks (each run would change it, and `dvc metrics diff` would
# report noise). A key is a timing when one of its `/`-separated parts matches (`train_seconds`,
# `seconds_per_item`, `items_per_s`, `train_s`, `ms_per_item`, `time_reduction`, ...);
# `tokens_per_solved` is not one.
TIMING_PART = re.compile(r"seconds|(^|_)(s|ms)$|(^|_)ms_|(^|_)per_s($|_)|(^|_)(time|wall)($|_)"
                         r"|elapsed|latency|throughput", re.IGNORECASE)


# In a stage whose durations are its results (a simulator's latencies in simulated seconds, the
# latency profile a stage exists to measure), only a key that says it is wall-clock time is one:
# such a module sets `TIMES_ARE_RESULTS = True` and names its own wall times `wall_*`/`*seconds`.
WALL_PART = re.compile(r"seconds|(^|_)wall($|_)|elapsed", re.IGNORECASE)


def is_timing_key(key: str, *, times_are_results: bool = False) -> bool:
    rule = WALL_PART if times_are_results else TIMING_PART
    return any(rule.search(part) for part in key.split("/"))


def write_metrics(path: str | os.PathLike[str], metrics: dict[str, float]) -> Path:
    """A flat {key: number} file for DVC (headline metrics, details): sorted keys, and an
    undefined value (NaN, +-inf) written as `null`. Python's `NaN` token is not JSON, and
    `dvc metrics diff` reports NaN -> NaN as a change (NaN != NaN); DVC skips a null, so an
    undefined value shows as `-` and never as a change. `read_metrics` gives NaN back."""
    clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
    return write_text(path, json.dumps(clean, indent=2, sort_keys=True, allow_nan=False) + "\n")


def read_metrics(path: str | os.PathLike[str]) -> dict[str, float]:
    """A file written by `write_metrics` (or an older one with NaN tokens): null -> NaN."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of metrics")
    return {k: (math.nan if v is None else v) for k, v in data.items()}


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_parquet(path: str | os.PathLike[str], df: Any) -> Path:
    """Write a polars DataFrame as parquet, atomically, in one canonical layout: the same rows
    give the same bytes however the frame is chunked in memory (polars splits row groups along
    its chunks, and the chunks of a `pl.concat` can depend on thread timing: an Early Experience
    rerun wrote the same rollouts as 2 row groups instead of 1)."""
    with atomic_path(path) as tmp:
        df.rechunk().write_parquet(tmp)
    return Path(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_tmp(directory: str | os.PathLike[str], name: str | None = None) -> int:
    """Remove temporaries left by a killed writer: `.<name>.tmp-<pid>-<id>` whose pid is dead.

    With `name`, only temporaries of that output are considered. Returns how many were removed.
    """
    removed = 0
    d = Path(directory)
    if not d.is_dir():
        return 0
    for p in d.iterdir():
        m = TMP_NAME.match(p.name)
        if m is None or (name is not None and m["name"] != name):
            continue
        if not _pid_alive(int(m["pid"])):
            _remove(p)
            removed += 1
    return removed


def clean_stale_tmp_in(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Remove dead writers' temporaries next to every path in `paths` (a pipeline's declared
    outputs) and, for a path that is a folder (`metrics/`, a model folder), inside it too; never
    those of a live pid. Returns how many were removed."""
    folders: set[Path] = set()
    for p in map(Path, paths):
        folders.add(p.parent)
        if p.is_dir():
            folders.add(p)
    return sum(clean_stale_tmp(d) for d in sorted(folders))


def clean_repo_tmp(root: str | os.PathLike[str]) -> int:
    """`clean_stale_tmp_in` over every output DVC knows in the repo (every pipeline's outs,
    metrics and plots): what `paperline repro` / `paperline run` remove before they start, since a
    stage restored from the cache never starts to remove them itself.

    The outputs are read from the `dvc.lock` files (paths relative to each lock's folder), not
    from DVC's index: building the index of every pipeline took most of a no-op `paperline
    repro`. A stage that never completed has no lock entry; its own start cleans its outputs
    (stages/core/runner.py)."""
    import yaml

    root = Path(root).resolve()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    outs = []
    for lock in [root / "dvc.lock", *sorted((root / "pipelines").glob("*/dvc.lock"))]:
        if not lock.is_file():
            continue
        data = yaml.load(lock.read_text(), Loader=loader) or {}
        for stage in (data.get("stages") or {}).values():
            for out in stage.get("outs") or []:
                outs.append((lock.parent / out["path"]).resolve())
    return clean_stale_tmp_in(p for p in outs if p.is_relative_to(root))


def save_model(model: Any, tokenizer: Any, path: str | os.PathLike[str]) -> Path:
    """Save a Hugging Face model and its tokenizer as one `save_pretrained` folder (safetensors),
    atomically: a killed stage leaves the previous folder or none, never weights without config."""
    with atomic_path(path, is_dir=True) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return Path(path)
