"""One Prefect deployment per pipeline: `paperline/paperline-<slug>`, on a `process` work pool.

    paperline stack up && paperline deploy      # then press "Run" in the Prefect UI

The code comes from the local repo folder (`flow.from_source(<repo>, "flows/runner.py:
pipeline_flow")`): a process worker on this machine (the one `paperline stack up` starts) runs the
flow with that folder as its working directory, exactly as `paperline run <slug>` would.

The run form of each deployment (Prefect UI: the deployment, *Run* > *Custom run*) holds the
flow's typed parameters (flows/runner.py `pipeline_flow`): `pipeline` fixed (read-only),
`profile` (smoke | cpu | gpu, default: the one params.yaml has; a choice is written to
params.yaml, as `dvc exp run -S profile=...` does), `force` (recompute up-to-date stages),
`targets` (a pick list of the pipeline's stages; empty: all), `max_parallel`, `retries`. Each run
publishes its stage table and the pipeline's results table as a markdown artifact
(`<slug>-results`, the run's *Artifacts* tab).

The Prefect API is `PREFECT_API_URL` if set, else the local stack's server when it is up.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Iterator

ENTRYPOINT = "flows/runner.py:pipeline_flow"


@contextlib.contextmanager
def prefect_api(root: Path) -> Iterator[str | None]:
    """Use `PREFECT_API_URL` if configured, else the stack's server (if up)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import stack

    current = PREFECT_API_URL.value()
    url = current or stack.prefect_api_url(root)
    if current or not url:
        yield current
        return
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url


def ensure_work_pool(name: str, pool_type: str = "process") -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
            if pool.type != pool_type:
                raise ValueError(f"work pool {name!r} has type {pool.type!r}, "
                                 f"expected {pool_type!r}")
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_work_pool(WorkPoolCreate(name=name, type=pool_type))


def apply_profile(root: Path, profile: str, logger: Any = None) -> bool:
    """Set `profile:` in the repo's params.yaml (a tracked DVC parameter: the stages whose
    sizes depend on it rerun); returns whether it changed. Comments and order are kept."""
    import re

    from stages.core import io
    from stages.core.config import PROFILES, active_profile, did_you_mean, read_yaml

    if profile not in PROFILES:
        raise did_you_mean(profile, PROFILES, "profile")
    path = Path(root) / "params.yaml"
    if active_profile(read_yaml(path), str(path)) == profile:
        return False
    text = path.read_text()
    line = re.compile(r"^profile:[ \t]*[^\s#]*", re.M)  # the value only: its comment stays
    text = (line.sub(f"profile: {profile}", text, count=1) if line.search(text)
            else f"profile: {profile}\n{text}")
    io.write_text(path, text)
    if logger is not None:
        logger.info("params.yaml: profile set to %s (kept after the run)", profile)
    return True


def run_form(schema: dict[str, Any], stages: list[str]) -> dict[str, Any]:
    """The deployment's parameter schema with pick lists: `profile` among the profiles,
    `targets` among the pipeline's stages (what the UI's run form shows)."""
    from stages.core.config import PROFILES

    props = schema.get("properties", {})
    choices = {"profile": list(PROFILES), "targets": stages}
    for name, values in choices.items():
        for variant in props.get(name, {}).get("anyOf", []):  # `X | None`: the X variant
            if variant.get("type") == "string":
                variant["enum"] = values
            elif variant.get("type") == "array":
                variant["items"] = {"type": "string", "enum": values}
    return schema


def own_stages(root: Path, pipeline: str) -> list[str]:
    """The stage names of the pipeline's own dvc.yaml (what `targets` may name)."""
    from stages.core.config import read_yaml
    from stages.core.runner import pipeline_dir

    return list(read_yaml(pipeline_dir(root, pipeline) / "dvc.yaml").get("stages") or {})


def code_dir(root: Path) -> Path:
    """Where the flow's code lives: the repo itself, or (a repo without `flows/`, e.g. a
    synthetic test repo) the installed paperline checkout."""
    if (root / ENTRYPOINT.split(":")[0]).is_file():
        return root
    return Path(__file__).resolve().parents[1]


def deploy_all(root: Path, work_pool: str = "paperline-cpu",
               pipelines: list[str] | None = None) -> list[str]:
    """Create or update deployment `paperline-<slug>` for every pipeline (or those named);
    returns the full names (`paperline/paperline-<slug>`)."""
    from prefect.deployments.runner import deploy
    from prefect.flows import Flow
    from prefect.utilities.annotations import freeze

    from stages.core.config import did_you_mean
    from stages.core.runner import pipeline_dirs

    root = Path(root).resolve()
    known = pipeline_dirs(root)
    for p in pipelines or []:
        if p not in known:
            raise did_you_mean(p, known, "pipeline")
    src = code_dir(root)
    names = []
    with prefect_api(root) as url:
        if not url:
            raise RuntimeError("no Prefect server: start one with `paperline stack up` "
                               "or set PREFECT_API_URL")
        ensure_work_pool(work_pool)
        flow = Flow.from_source(source=str(src), entrypoint=ENTRYPOINT)
        for slug in pipelines or list(known):
            params: dict[str, Any] = {"pipeline": freeze(slug)}  # read-only in the run form
            if src != root:
                params["root"] = str(root)
            deployment = flow.to_deployment(
                name=f"paperline-{slug}", parameters=params, tags=["paperline", slug],
                description=f"paperline pipeline {slug!r}: its DVC DAG run by Prefect")
            run_form({"properties": deployment._parameter_openapi_schema.properties},
                     own_stages(root, slug))
            with contextlib.redirect_stdout(io.StringIO()):  # Prefect's table; we name them
                deploy(deployment, work_pool_name=work_pool, build=False, push=False,
                       print_next_steps_message=False, ignore_warnings=True)
            names.append(f"{flow.name}/paperline-{slug}")
    return names
