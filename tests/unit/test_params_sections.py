"""Top-level params sections: a misspelled section is an error naming its file, not silently
ignored; unknown keys in list items are compared with the item's fields; the shared stages
validate every pipeline's params before any compute."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stages.core.config import ParamsError, check_sections, model_at, validate_section
from stages.core.runner import load_params, run_stage

REPO = Path(__file__).resolve().parents[2]


def make_repo(tmp_path: Path, *slugs: str) -> Path:
    """The real root params and the named pipelines' params/dvc.yaml, nothing else."""
    root = tmp_path / "repo"
    (root / ".dvc").mkdir(parents=True)
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    for slug in slugs:
        (root / "pipelines" / slug).mkdir(parents=True)
        for name in ("params.yaml", "dvc.yaml"):
            shutil.copy(REPO / "pipelines" / slug / name, root / "pipelines" / slug / name)
    return root


def edit(path: Path, change) -> None:
    params = yaml.safe_load(path.read_text())
    change(params)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def rename(params: dict, old: str, new: str) -> None:
    params[new] = params.pop(old)


def test_every_committed_params_file_passes(tmp_path: Path):
    root = make_repo(tmp_path, "bis", "edco", "hsir", "proofverify", "r2vpo", "racer", "trace",
                     "cotfsm", "diffureason", "early_experience")
    for slug in ("base", "bis", "edco", "hsir", "proofverify", "r2vpo", "racer", "trace",
                 "cotfsm", "diffureason", "early_experience"):
        load_params(root, slug)


def test_misspelled_pipeline_section_is_named_with_a_suggestion(tmp_path: Path):
    root = make_repo(tmp_path, "racer")
    edit(root / "pipelines/racer/params.yaml",
         lambda p: (rename(p, "features", "featuresX"), rename(p, "solver_check", "solver_chek")))
    with pytest.raises(ParamsError) as exc:
        load_params(root, "racer")
    msg = str(exc.value)
    assert ("pipelines/racer/params.yaml: unknown section 'featuresX'. Did you mean 'features'"
            in msg)
    assert "unknown section 'solver_chek'. Did you mean 'solver_check'" in msg
    assert "shared_sections" in msg  # how to declare an anchor section on purpose


def test_misspelled_root_section_is_blamed_on_the_root_file(tmp_path: Path):
    root = make_repo(tmp_path, "racer")
    edit(root / "params.yaml", lambda p: rename(p, "tokenizer", "tokeniser"))
    with pytest.raises(ParamsError) as exc:
        load_params(root, "racer")
    msg = str(exc.value)
    assert msg.startswith("params.yaml: unknown section 'tokeniser'. Did you mean 'tokenizer'")
    assert "pipelines/racer" not in msg


def test_shared_sections_must_be_declared_and_exist(tmp_path: Path):
    root = make_repo(tmp_path, "r2vpo")
    path = root / "pipelines/r2vpo/params.yaml"
    edit(path, lambda p: p.pop("shared_sections"))
    with pytest.raises(ParamsError, match="unknown section 'rl_common'.*shared_sections"):
        load_params(root, "r2vpo")
    edit(path, lambda p: p.update(shared_sections=["rl_common", "rl_comon"]))
    with pytest.raises(ParamsError, match="shared_sections lists 'rl_comon', but the file has no"):
        load_params(root, "r2vpo")


def test_profile_in_a_pipeline_file_points_at_the_root_file():
    errors = check_sections({"profile": "smoke"}, ["features"], "pipelines/racer/params.yaml",
                            root_file=False)
    assert len(errors) == 1
    assert "'profile' is set in the root params.yaml only" in errors[0]
    assert "dvc exp run -S ../../params.yaml:profile=<value>" in errors[0]


def test_profile_overrides_name_stages_and_profiles():
    params = {"profiles": {"smoke": {"featurs": {"n": 1}}, "cpus": {}}}
    errors = check_sections(params, ["features", "judges"], "p.yaml", root_file=False)
    assert any("profiles.smoke.featurs: unknown stage 'featurs'. Did you mean 'features'" in e
               for e in errors), errors
    assert any("profiles.cpus: unknown profile 'cpus'. Did you mean 'cpu'" in e
               for e in errors), errors


def test_unknown_key_in_a_list_item_is_compared_with_the_items_fields(tmp_path: Path):
    from stages.racer.racer import Arm, Config

    root = make_repo(tmp_path, "racer")
    edit(root / "pipelines/racer/params.yaml",
         lambda p: p["train_router"]["arms"][5].update(tau=1.0))
    _, params, source = load_params(root, "racer")
    with pytest.raises(ParamsError) as exc:
        validate_section(Config, params, "train_router", "cpu", source)
    msg = str(exc.value)
    assert "train_router.arms.5.tau = 1.0: unknown key" in msg
    assert "did you mean 'tau_r' (train_router.arms.5.tau_r) instead of 'tau'?" in msg
    assert ("known keys of train_router.arms.5: name, robust_reward, robust_cost, tau_r, tau_c"
            in msg)
    assert "'arms' instead of 'arms'" not in msg
    assert model_at(Config, ("arms", 5)) is Arm and model_at(Config, ("budgets", 0)) is None


def test_shared_stage_validates_every_pipeline_before_compute(tmp_path: Path):
    """`dvc repro` in pipelines/racer runs tasks/tokenizer/base first: they must refuse a typo in
    racer's params (in-process, and through the entry point every dvc.yaml cmd calls)."""
    root = make_repo(tmp_path, "racer", "bis")
    run_stage("base", "tasks", check_only=True, root=root)  # all valid
    edit(root / "pipelines/racer/params.yaml",
         lambda p: p["profiles"]["cpu"]["train_router"].update(iters=0))
    edit(root / "pipelines/bis/params.yaml", lambda p: rename(p, "select", "selct"))
    with pytest.raises(ParamsError) as exc:
        run_stage("base", "tasks", check_only=True, root=root)
    msg = str(exc.value)
    assert "(pipeline 'racer'" in msg and "train_router.iters = 0" in msg
    assert "(pipeline 'bis'" in msg and "unknown section 'selct'. Did you mean 'select'" in msg
    proc = subprocess.run([sys.executable, "-m", "stages", "base", "base"], cwd=root,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert "unknown section 'selct'" in proc.stderr and "Traceback" not in proc.stderr


def test_arm_list_checks_of_compare_configs():
    from stages.core.config import check_arm, disjoint_arms, unique_arms

    assert unique_arms(["a", "b"]) == ["a", "b"]
    with pytest.raises(ValueError, match=r"arms \['a', 'b', 'a'\] list an arm twice"):
        unique_arms(["a", "b", "a"])
    check_arm("method", "a", ["a", "b"])                  # an arm, no baseline to differ from
    check_arm("method", "a", ["a", "b"], baseline="b")
    check_arm("method", None, ["a", "b"], baseline="b")   # untested
    check_arm("rl_method", "x", [], baseline="y")         # that family is not run
    with pytest.raises(ValueError, match="method 'c' is not one of the arms"):
        check_arm("method", "c", ["a", "b"])
    with pytest.raises(ValueError, match="method 'b' must be one of the arms .* other than the "
                                         "baseline 'b'"):
        check_arm("method", "b", ["a", "b"], baseline="b")
    with pytest.raises(ValueError, match="method 'c' must be one of the arms"):
        check_arm("method", "c", ["a", "b"], baseline="b")
    disjoint_arms(["a"], ["b"], "SFT and RL")
    with pytest.raises(ValueError, match=r"\['b'\] are listed as both SFT and RL arms"):
        disjoint_arms(["a", "b"], ["b", "c"], "SFT and RL")
