"""One Prefect deployment per pipeline: `paperline/paperline-<slug>`, on a `process` work pool.

    paperline stack up && paperline deploy      # then press "Run" in the Prefect UI

The code comes from the local repo folder (`flow.from_source(<repo>, "flows/runner.py:
pipeline_flow")`): a process worker on this machine (the one `paperline stack up` starts) runs the
flow with that folder as its working directory, exactly as `paperline run <slug>` would. Each
deployment fixes the parameter `pipeline`; the others (`targets`, `max_parallel`, `retries`,
`force`) keep the flow's defaults and can be changed per run in the UI.

The Prefect API is `PREFECT_API_URL` if set, else the local stack's server when it is up.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Iterator

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
    from prefect.flows import Flow

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
            params = {"pipeline": slug}
            if src != root:
                params["root"] = str(root)
            with contextlib.redirect_stdout(io.StringIO()):  # Prefect's table; we name them
                flow.deploy(name=f"paperline-{slug}", work_pool_name=work_pool,
                            parameters=params, tags=["paperline", slug],
                            description=f"paperline pipeline {slug!r}: its DVC DAG run by Prefect",
                            print_next_steps=False, ignore_warnings=True)
            names.append(f"{flow.name}/paperline-{slug}")
    return names
