"""Same inputs, same bytes: a pipeline reproduced in a second fresh clone at `smoke` writes outputs
whose DVC hashes equal the first clone's, stage by stage.

Run 1 is the smoke repro the pipeline's own test module already made (`smoke_repo` for `base`, a
module fixture for the others), its stages forked from the test session's shared fork server
(the one `paperline repro` uses under tests: tests/conftest.py `shared_forkserver`, warm from
earlier repros). Run 2 is a fresh `copy_repo` reproduced the same way (or only some stages of
it, `only=`) under another inherited `PYTHONHASHSEED`, which every stage must override
(stages/core/proc.py), with no fork server: every stage a fresh interpreter
(stages/core/forkserver.py). A pipeline other than `base` gets run 1's root-stage outputs, lock and
cache objects (not the run-cache), so `base` is not retrained while every stage of the pipeline
under test computes again; the test checks from dvc's log that each of them ran.

What is compared, per stage of the pipeline's dvc.yaml: the md5 in dvc.lock of every `outs`,
`plots` and `metrics` entry, the `details/` and `metrics/` files included: no tracked file holds a
wall time (those go to MLflow only, stages/core/io.py `is_timing_key`). On a mismatch the message
names the stage, the output and, for a folder, the files inside that differ.

The test of each pipeline lives in its own module (with `--dist loadfile` only that module's
worker holds its run 1); this one holds the helper and the `base` test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import copy_repo, dvc, paperline

pytestmark = pytest.mark.slow

OTHER_HASH_SEED = "123"  # run 1 inherits pytest's environment (random per process, or unset)


def ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '(?:[^']*:)?([^':]+)'", output))


def locked_outputs(repo: Path, dvcfile: str) -> dict[tuple[str, str], tuple[str, str, Path]]:
    """(stage, output) -> (kind, md5 recorded in dvc.lock, file) for every stage of `dvcfile`."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        return {(s.name, o.def_path): ("metrics" if o.metric else "plots" if o.plot else "outs",
                                       o.hash_info.value, Path(o.fs_path))
                for s in r.index.stages if s.path_in_repo == dvcfile for o in s.outs}


def _object(repo: Path, md5: str) -> Path:
    return repo / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


def _dir_diff(first: Path, second: Path, md5s: tuple[str, str]) -> list[str]:
    """The files of a folder output whose bytes differ between the two runs."""
    entries = []
    for repo, md5 in zip((first, second), md5s):
        obj = _object(repo, md5)
        entries.append({e["relpath"]: e["md5"] for e in json.loads(obj.read_text())}
                       if obj.is_file() else {})
    return sorted(p for p in entries[0].keys() | entries[1].keys()
                  if entries[0].get(p) != entries[1].get(p))


def share_root_stages(first: Path, second: Path) -> None:
    """Give `second` the root (`base`) stages as `first` finished them: lock, workspace outputs and
    their cache objects. No run-cache: a stage of another pipeline cannot be restored, it runs."""
    shutil.copy2(first / "dvc.lock", second / "dvc.lock")
    for stage in yaml.safe_load((first / "dvc.lock").read_text())["stages"].values():
        for out in stage.get("outs", []):
            src, dst = first / out["path"], second / out["path"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst)
            else:
                shutil.copy2(src, dst)
            md5s = [out["md5"]]
            if out["md5"].endswith(".dir") and _object(first, out["md5"]).is_file():
                md5s += [e["md5"] for e in json.loads(_object(first, out["md5"]).read_text())]
            for md5 in md5s:  # uncached outputs (metrics, plots) have no object
                if _object(first, md5).is_file():
                    _object(second, md5).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(_object(first, md5), _object(second, md5))


def assert_same_bytes(first: Path, pipeline: str, dvcfile: str, dest: Path,
                      monkeypatch: pytest.MonkeyPatch, only: list[str] | None = None) -> None:
    """Reproduce `pipeline` in a fresh copy at `dest` and compare its outputs with `first`'s.

    `only`: these stages of `dvcfile` (each with its upstream stages, which must be among them)
    through `dvc repro <dvcfile>:<stage>`, instead of the whole pipeline through `paperline repro`.
    """
    assert os.environ.get("PYTHONHASHSEED") != OTHER_HASH_SEED
    second = copy_repo(dest)
    if pipeline != "base":
        share_root_stages(first, second)
    monkeypatch.setenv("PYTHONHASHSEED", OTHER_HASH_SEED)
    # Run 1 (`paperline repro`) ran its stages in forks of a fork server; run 2 starts each
    # stage as a fresh interpreter, as a plain `dvc repro` or a Prefect worker does: the bytes
    # must not depend on how a stage process started (stages/core/forkserver.py).
    monkeypatch.setenv("PAPERLINE_FORKSERVER", "off")
    if only:
        proc = dvc(second, "repro", *[f"{dvcfile}:{stage}" for stage in only], timeout=1800)
    else:
        proc = paperline(second, "repro", pipeline, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    one, two = locked_outputs(first, dvcfile), locked_outputs(second, dvcfile)
    if only:
        one, two = ({key: value for key, value in outs.items() if key[0] in only}
                    for outs in (one, two))
    assert one.keys() == two.keys()
    stages = {stage for stage, _ in one}
    assert ran(proc.stdout) == stages, proc.stdout[-4000:]  # each compared stage computed again

    compared, differ = [], []
    for key, (kind, md5, path) in sorted(one.items()):
        other = two[key][1]
        compared.append(key)
        if md5 != other:
            inside = _dir_diff(first, second, (md5, other)) if md5.endswith(".dir") else []
            differ.append(f"{key[0]}: {kind} {key[1]} {md5} != {other}"
                          + (f" (files: {', '.join(inside[:20])})" if inside else ""))
    print(f"{pipeline}: compared {len(compared)} outputs of {len(stages)} stages")
    assert not differ, f"{pipeline}: outputs differ between two fresh clones:\n" + "\n".join(differ)


def test_base_outputs_are_the_same_bytes_in_a_second_clone(smoke_repo: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    assert_same_bytes(smoke_repo, "base", "dvc.yaml", tmp_path / "repo", monkeypatch)
