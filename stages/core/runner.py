"""Run one stage under the contract: resolve names, validate params, track, write metrics."""

from __future__ import annotations

import importlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from . import io
from .config import (
    ParamsError,
    active_profile,
    check_sections,
    did_you_mean,
    find_root,
    read_yaml,
    resolve_paths,
    validate_section,
)
from .context import Context

log = logging.getLogger("paperline")


def pipeline_dirs(root: Path) -> dict[str, Path]:
    """Pipelines: 'base' (the root dvc.yaml) and every `pipelines/<slug>/` holding a dvc.yaml."""
    found = {"base": root}
    pdir = root / "pipelines"
    if pdir.is_dir():
        for d in sorted(pdir.iterdir()):
            if (d / "dvc.yaml").is_file() and d.name != "base":
                found[d.name] = d
    return found


def pipeline_dir(root: Path, pipeline: str) -> Path:
    dirs = pipeline_dirs(root)
    if pipeline not in dirs:
        raise did_you_mean(pipeline, dirs, "pipeline")
    return dirs[pipeline]


def stage_modules(pipeline: str) -> dict[str, str]:
    from stages.registry import STAGES

    if pipeline not in STAGES:
        raise did_you_mean(pipeline, STAGES, "pipeline")
    return STAGES[pipeline]


def load_module(pipeline: str, stage: str) -> ModuleType:
    modules = stage_modules(pipeline)
    if stage not in modules:
        raise did_you_mean(stage, modules, f"stage of pipeline {pipeline!r}")
    return importlib.import_module(modules[stage])


def load_params(root: Path, pipeline: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(root params, pipeline params merged over root params, source label).

    A top-level section that no stage reads (a typo such as `featuresX:`) fails here, blamed on
    the file that holds it: the root params.yaml or the pipeline's own.
    """
    root_params = read_yaml(root / "params.yaml")
    errors = check_sections(root_params, stage_modules("base"), "params.yaml", root_file=True)
    pdir = pipeline_dir(root, pipeline)
    if pdir == root:
        own, source = {}, "params.yaml"
    else:
        source = str((pdir / "params.yaml").relative_to(root))
        own = read_yaml(pdir / "params.yaml") if (pdir / "params.yaml").is_file() else {}
        from stages.registry import STAGES

        if pipeline in STAGES:  # a folder not yet registered has no stage names to check against
            errors += check_sections(own, STAGES[pipeline], source, root_file=False)
    if errors:
        raise ParamsError("\n".join(errors))
    if pdir == root:
        return root_params, root_params, source
    merged = dict(root_params)
    for key, value in own.items():
        if key == "paths":
            continue  # pipeline paths are resolved against the pipeline folder, below
        merged[key] = value
    return root_params, merged, source


def build_context(root: Path, pipeline: str, stage: str) -> tuple[Context, dict[str, Any], str]:
    root_params, params, source = load_params(root, pipeline)
    profile = active_profile(root_params)
    seed = root_params.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ParamsError(f"params.yaml: seed = {seed!r}: expected a non-negative integer")
    pdir = pipeline_dir(root, pipeline)
    paths = resolve_paths(root_params.get("paths", {}), root, "params.yaml")
    if pdir != root and (pdir / "params.yaml").is_file():
        own = read_yaml(pdir / "params.yaml").get("paths", {})
        clash = set(own) & set(paths)
        if clash:
            raise ParamsError(f"{source}: paths {sorted(clash)} already declared in params.yaml")
        paths.update(resolve_paths(own, pdir, source))
    if "metrics" not in paths:
        raise ParamsError(f"{source}: paths.metrics is missing: the folder for stage metrics")
    ctx = Context(root=root, pipeline=pipeline, stage=stage, pipeline_dir=pdir, profile=profile,
                  seed=seed, paths=paths, params=params)
    return ctx, params, source


def check_device_env(environ: Any = os.environ) -> None:
    """$PAPERLINE_DEVICE, when set, names a device torch has here (`cpu`, `cuda`, `cuda:1`, ...);
    checked with the params, so a typo fails before any compute rather than inside torch."""
    value = environ.get("PAPERLINE_DEVICE", "").strip()
    if not value:
        return
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ParamsError(f"$PAPERLINE_DEVICE = {value!r} is not a torch device ({exc}); "
                          "use cpu, cuda or cuda:<index>, or unset it") from None
    if device.type == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            raise ParamsError(f"$PAPERLINE_DEVICE = {value!r}, but torch sees no CUDA GPU here; "
                              "unset it or use cpu")
        if device.index is not None and device.index >= n:
            raise ParamsError(f"$PAPERLINE_DEVICE = {value!r}, but torch sees {n} GPU(s) here "
                              f"(cuda:0 to cuda:{n - 1})")


def validate_pipeline(pipeline: str, params: dict[str, Any], profile: str, source: str, *,
                      check_device: bool = True, root: Path | None = None) -> dict:
    """Validate every stage's section of the pipeline (and $PAPERLINE_DEVICE, unless the stages
    run on other machines); returns stage -> config.

    With `root`, a stage of `base` validates every registered pipeline's params too: `dvc repro`
    of a paper's pipeline runs the shared stages (tasks, tokenizer, base) first, and a typo in the
    paper's params must fail before them, not after the base model has trained."""
    if check_device:
        check_device_env()
    configs = {}
    errors = []
    for name in stage_modules(pipeline):
        module = load_module(pipeline, name)
        try:
            configs[name] = validate_section(module.Config, params, name, profile, source)
        except ParamsError as exc:
            errors.append(str(exc))
    if root is not None and pipeline == "base":
        from stages.registry import STAGES

        for other in pipeline_dirs(root):
            if other == "base" or other not in STAGES:
                continue  # an unregistered folder's stages cannot run `python -m stages` anyway
            try:
                _, other_params, other_source = load_params(root, other)
                validate_pipeline(other, other_params, profile, other_source, check_device=False)
            except ParamsError as exc:
                errors.append(f"(pipeline {other!r}, checked by the shared stages every pipeline "
                              f"runs first)\n{exc}")
    if errors:
        raise ParamsError("\n".join(errors))
    return configs


def check_key(root: Path, pipeline: str, *, device: bool = True) -> str:
    """What a whole-pipeline params check depends on: every params file of the repo (a shared
    stage checks every pipeline) and every stage module, by path, size and mtime (cheap to read),
    plus $PAPERLINE_DEVICE. Validating means importing every stage module (torch among them):
    most of a small stage's start-up, and of a no-op `paperline repro`, so a check that passed is
    not repeated until one of these changes."""
    import hashlib

    h = hashlib.sha256(f"{pipeline}:{device}:{os.environ.get('PAPERLINE_DEVICE', '')}".encode())
    for f in [root / "params.yaml", *sorted((root / "pipelines").glob("*/params.yaml"))]:
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes() if f.is_file() else b"-")
    for f in sorted((root / "stages").rglob("*.py")):
        st = f.stat()
        h.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _check_stamp(root: Path, pipeline: str) -> Path:
    return root / ".paperline" / "cache" / "params-valid" / pipeline


def checked_before(root: Path, pipeline: str, key: str) -> bool:
    stamp = _check_stamp(root, pipeline)
    return stamp.is_file() and stamp.read_text() == key


def mark_checked(root: Path, pipeline: str, key: str) -> None:
    io.write_text(_check_stamp(root, pipeline), key)


def run_stage(pipeline: str, stage: str, *, check_only: bool = False,
              root: Path | None = None) -> dict[str, float]:
    root = root or find_root()
    module = load_module(pipeline, stage)  # unknown names fail here, with a suggestion
    ctx, params, source = build_context(root, pipeline, stage)
    key = check_key(root, pipeline)
    if not check_only and checked_before(root, pipeline, key):  # only this stage's section
        check_device_env()
        configs = {stage: validate_section(module.Config, params, stage, ctx.profile, source)}
    else:
        configs = validate_pipeline(pipeline, params, ctx.profile, source, root=root)
        mark_checked(root, pipeline, key)
    cfg = configs[stage]
    if check_only:
        print(f"{pipeline}: params of {len(configs)} stages are valid (profile {ctx.profile})")
        return {}

    from .tracking import StageTracker

    # what a killed earlier run of any stage left behind, in every output folder, metrics included
    io.clean_stale_tmp_in([*ctx.paths.values(), ctx.metrics_dir, ctx.details_dir])
    started = time.time()
    with StageTracker(ctx, cfg) as tracker:
        ctx.tracker = tracker
        returned = {k: float(v) for k, v in (module.run(cfg, ctx) or {}).items()}
        details, summary = split_metrics(module, returned)
        io.write_metrics(ctx.details_path, details)
        io.write_metrics(ctx.metrics_path, summary)
        tracker.log_metrics({**returned, **summary, "stage_seconds": time.time() - started})
    log.info("%s/%s done in %.1fs: %s", pipeline, stage, time.time() - started, summary)
    return summary


def split_metrics(module: ModuleType, returned: dict[str, float]
                  ) -> tuple[dict[str, float], dict[str, float]]:
    """(details, headline) of what a stage's `run()` returned, timings left out of both.

    Wall times and throughputs (`io.is_timing_key`) go to MLflow only. The headline, what
    `dvc metrics show` and `dvc metrics diff` print, is the module's `headline(details)` (a
    handful of flat keys per stage), or every number when the module defines none; details
    (every number) go to `details/<stage>.json`, which the README tables are rendered from."""
    results = bool(getattr(module, "TIMES_ARE_RESULTS", False))
    details = {k: v for k, v in returned.items()
               if not io.is_timing_key(k, times_are_results=results)}
    pick = getattr(module, "headline", None)
    summary = {k: float(v) for k, v in (pick(dict(details)) if pick else details).items()}
    timed = sorted(k for k in summary if io.is_timing_key(k, times_are_results=results))
    if timed:  # a headline that computes a timing of its own: still kept out of DVC
        log.warning("%s.headline returned wall times %s: left out of the DVC metrics",
                    module.__name__, timed)
    return details, {k: v for k, v in summary.items() if k not in timed}


def repo_root() -> Path:
    return find_root(os.environ.get("PAPERLINE_ROOT") or None)
