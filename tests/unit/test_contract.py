"""The stage contract: params validation messages, profiles, names, atomic writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.core.config import (
    ParamsError,
    UnknownNameError,
    active_profile,
    deep_merge,
    did_you_mean,
    section_for,
    validate_section,
)


class Toy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(1e-3, gt=0, description="learning rate")
    steps: int = Field(10, ge=1, le=1000, description="optimizer steps")


def test_profile_overrides_apply_to_the_stage_section():
    params = {"toy": {"lr": 0.1, "steps": 5},
              "profiles": {"smoke": {"toy": {"steps": 2}}, "cpu": {"toy": {}}}}
    assert section_for(params, "toy", "smoke", "p") == {"lr": 0.1, "steps": 2}
    assert section_for(params, "toy", "cpu", "p") == {"lr": 0.1, "steps": 5}
    assert validate_section(Toy, params, "toy", "smoke", "p").steps == 2


def test_deep_merge_keeps_untouched_nested_keys():
    assert deep_merge({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}}) == {"a": {"x": 1, "y": 3}, "b": 1}


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ParamsError) as err:
        validate_section(Toy, {"toy": {"stpes": 3}}, "toy", "cpu", "params.yaml")
    msg = str(err.value)
    assert "params.yaml" in msg and "toy.stpes" in msg and "unknown key" in msg
    assert "'steps'" in msg  # did you mean


def test_wrong_type_names_key_value_and_expectation():
    with pytest.raises(ParamsError) as err:
        validate_section(Toy, {"toy": {"lr": "fast"}}, "toy", "cpu", "params.yaml")
    msg = str(err.value)
    assert "toy.lr = 'fast'" in msg and "number" in msg


def test_out_of_range_names_the_bound():
    with pytest.raises(ParamsError) as err:
        validate_section(Toy, {"toy": {"steps": 0}}, "toy", "cpu", "params.yaml")
    assert "toy.steps = 0" in str(err.value) and "greater than or equal to 1" in str(err.value)


def test_bad_profile_is_rejected():
    assert active_profile({"profile": "smoke"}) == "smoke"
    with pytest.raises(ParamsError, match="profile = 'laptop'.*smoke, cpu, gpu"):
        active_profile({"profile": "laptop"})


def test_did_you_mean():
    err = did_you_mean("evalute", ["tasks", "evaluate", "base"], "stage")
    assert isinstance(err, UnknownNameError)
    assert "Did you mean 'evaluate'" in str(err)
    assert "Did you mean" not in str(did_you_mean("zzz", ["tasks"], "stage"))


def test_atomic_write_replaces_and_cleans_up(tmp_path: Path):
    target = tmp_path / "out.json"
    io.write_json(target, {"a": 1})
    with pytest.raises(RuntimeError):
        with io.atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text().strip().startswith("{")  # the old content survives
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left


def test_parquet_bytes_do_not_depend_on_how_the_frame_is_chunked(tmp_path: Path):
    """The same rows, concatenated from 1, 2 or 9 parts (a `pl.concat` without rechunk keeps
    them, and its chunks can depend on thread timing): the same file, byte for byte. Polars
    alone writes the 9 parts in other bytes than the single one (2 row groups instead of 1)."""
    import polars as pl

    rows = pl.DataFrame({"episode": list(range(140_000)),
                         "text": [f"go to the {i % 7} door, step {i}" for i in range(140_000)]})
    written = []
    for parts in (1, 2, 9):
        size = -(-rows.height // parts)
        df = pl.concat([rows.slice(i, size) for i in range(0, rows.height, size)],
                       rechunk=False)
        assert df.n_chunks() == parts
        written.append(io.write_parquet(tmp_path / f"{parts}.parquet", df).read_bytes())
    assert written[0] == written[1] == written[2]
    assert pl.read_parquet(tmp_path / "9.parquet").equals(rows)


def test_atomic_directory_swap(tmp_path: Path):
    target = tmp_path / "model"
    with io.atomic_path(target, is_dir=True) as d:
        (d / "w.bin").write_bytes(b"1")
    with io.atomic_path(target, is_dir=True) as d:
        (d / "w2.bin").write_bytes(b"2")
    assert sorted(p.name for p in target.iterdir()) == ["w2.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_killed_writer_leaves_no_output(tmp_path: Path):
    """SIGKILL mid-write: the target never appears half-written."""
    target = tmp_path / "big.txt"
    script = textwrap.dedent(f"""
        import time, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from stages.core import io
        with io.atomic_path({str(target)!r}) as tmp:
            with open(tmp, "w") as f:
                f.write("x" * 1000); f.flush()
                print("writing", flush=True)
                time.sleep(30)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert not target.exists()
    assert io.clean_stale_tmp(tmp_path) == 1
    assert list(tmp_path.iterdir()) == []


def test_bad_device_env_is_named_before_compute(monkeypatch):
    import torch

    from stages.core.runner import check_device_env

    check_device_env({})  # unset: the default placement
    check_device_env({"PAPERLINE_DEVICE": "cpu"})
    with pytest.raises(ParamsError, match=r"\$PAPERLINE_DEVICE = 'gpu' is not a torch device"):
        check_device_env({"PAPERLINE_DEVICE": "gpu"})
    n = torch.cuda.device_count()
    with pytest.raises(ParamsError, match=r"\$PAPERLINE_DEVICE = 'cuda:\d+', but torch sees"):
        check_device_env({"PAPERLINE_DEVICE": f"cuda:{n}"})  # one past the last GPU, or none
    # through the stage entry point, which every dvc.yaml cmd calls: exit 2, no traceback
    monkeypatch.setenv("PAPERLINE_DEVICE", "gpu")
    proc = subprocess.run([sys.executable, "-m", "stages", "base", "tasks", "--check"],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2, proc.stderr
    assert "$PAPERLINE_DEVICE = 'gpu'" in proc.stderr and "Traceback" not in proc.stderr
    # a `--distributed` controller skips it: the stages run in the workers' own environment
    from stages.core.runner import validate_pipeline

    with pytest.raises(ParamsError, match="PAPERLINE_DEVICE"):
        validate_pipeline("base", {}, "smoke", "params.yaml")
    assert validate_pipeline("base", {}, "smoke", "params.yaml", check_device=False)
