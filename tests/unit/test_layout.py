"""The house rules of the code layout: code deps generated from the imports, and no paper package
imports another (stages/core/codedeps.py). Each rule is also checked on a planted violation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stages.core import codedeps

REPO = Path(__file__).resolve().parents[2]


def _copy_sources(dest: Path) -> Path:
    """stages/ and every dvc.yaml: all the code-deps checker reads."""
    shutil.copytree(REPO / "stages", dest / "stages",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "dvc.yaml", dest / "dvc.yaml")
    for dvcfile in (REPO / "pipelines").glob("*/dvc.yaml"):
        (dest / "pipelines" / dvcfile.parent.name).mkdir(parents=True)
        shutil.copy(dvcfile, dest / "pipelines" / dvcfile.parent.name / "dvc.yaml")
    return dest


def test_every_stage_declares_exactly_its_imports():
    problems = codedeps.check(REPO)
    assert problems == {}, f"run `paperline deps --write`: {problems}"


def test_no_paper_imports_another_and_engines_import_no_paper():
    assert codedeps.import_rule_violations(REPO) == []


def test_code_deps_check_fails_on_a_planted_undeclared_import(tmp_path: Path):
    root = _copy_sources(tmp_path)
    features = root / "stages/racer/features.py"
    features.write_text(features.read_text() + "\n\ndef _planted():\n"
                        "    from stages.tasks import toulmin  # noqa: F401\n")
    problems = codedeps.check(root)
    assert problems["pipelines/racer/dvc.yaml"]["features"]["missing"] == [
        "stages/tasks/toulmin.py"]
    assert list(problems) == ["pipelines/racer/dvc.yaml"]  # only the stage that imports it
    # ... and `paperline deps --write` repairs exactly that
    assert codedeps.write(root) == ["pipelines/racer/dvc.yaml"]
    assert codedeps.check(root) == {}
    assert "../../stages/tasks/toulmin.py" in (root / "pipelines/racer/dvc.yaml").read_text()


def test_code_deps_check_names_a_declared_module_that_is_not_imported(tmp_path: Path):
    root = _copy_sources(tmp_path)
    dvcfile = root / "pipelines/racer/dvc.yaml"
    text = dvcfile.read_text()
    anchor = "    cmd: python -m stages racer features\n    deps:\n"
    assert anchor in text
    dvcfile.write_text(text.replace(anchor, anchor + "      - ../../stages/tasks/toulmin.py\n"))
    problems = codedeps.check(root)
    assert problems == {"pipelines/racer/dvc.yaml": {"features": {
        "missing": [], "extra": ["stages/tasks/toulmin.py"]}}}


def test_transitive_imports_count_and_type_checking_imports_do_not(tmp_path: Path):
    root = tmp_path
    pkg = root / "stages" / "demo"
    pkg.mkdir(parents=True)
    (root / "stages" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nfrom . import b\n"
                              "if TYPE_CHECKING:\n    from stages.demo import c\n")
    (pkg / "b.py").write_text("def f():\n    import stages.demo.d\n")
    (pkg / "c.py").write_text("X = 1\n")
    (pkg / "d.py").write_text("Y = 2\n")
    assert codedeps.required(root, "stages.demo.a") == [
        "stages/demo/a.py", "stages/demo/b.py", "stages/demo/d.py"]


@pytest.mark.parametrize("planted, expected", [
    ("stages/train/grpo.py", "shared code imports a paper"),
    ("stages/racer/compare.py", "paper 'racer' imports paper 'hsir'"),
])
def test_import_rule_fails_on_a_planted_violation(tmp_path: Path, planted: str, expected: str):
    root = _copy_sources(tmp_path)
    path = root / planted
    path.write_text(path.read_text() + "\n\ndef _planted():\n"
                    "    from stages.hsir import hsir  # noqa: F401\n")
    found = codedeps.import_rule_violations(root)
    assert found == [f"{planted}: imports stages.hsir.hsir ({expected})"]


def test_a_paper_package_named_apart_from_its_slug_is_checked_as_that_paper(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Pipeline `core` lives in stages/core_align (registry.PACKAGES): importing it from another
    paper breaks the rule, and stages/core (the contract) is never taken for a paper."""
    from stages import registry

    monkeypatch.setitem(registry.STAGES, "core", {"x": "stages.core_align.core"})
    root = _copy_sources(tmp_path)
    papers = codedeps.paper_packages(root)
    assert "core_align" in papers and "core" not in papers
    path = root / "stages/racer/compare.py"
    path.write_text(path.read_text() + "\n\ndef _planted():\n"
                    "    from stages.core_align import core  # noqa: F401\n")
    assert codedeps.import_rule_violations(root) == [
        "stages/racer/compare.py: imports stages.core_align.core "
        "(paper 'racer' imports paper 'core_align')"]
