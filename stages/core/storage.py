"""S3 storage for scale-out: the DVC remote and MLflow artifacts on one S3-compatible store.

    paperline remote setup [--local]   # write the DVC remote (URL, endpoint, region) into .dvc/config
    paperline remote check             # preflight: endpoint reachable, credentials accepted, bucket
                                       # exists and is writable; names endpoint and bucket on failure
    paperline remote push [target]...  # preflight, then `dvc push --run-cache` (outputs + run-cache)
    paperline remote pull [target]...  # preflight (read only), then `dvc pull --run-cache`

Where things go (one bucket, one prefix):

    s3://<bucket>/<prefix>/dvc       the DVC remote (content-addressed cache + run-cache)
    s3://<bucket>/<prefix>/mlflow    MLflow artifacts: the `--artifacts-destination` of an MLflow
                                     server (`paperline stack up`, infra/compose.yaml), or, with the
                                     embedded SQLite store, the artifact location of new experiments

Settings come from the `storage:` section of the root params.yaml, each overridable by the
environment (a worker in a container reaches the store under another host name than a laptop):

    storage:
      endpoint_url: http://127.0.0.1:8333   # PAPERLINE_S3_ENDPOINT_URL; empty = AWS itself
      bucket: paperline                     # PAPERLINE_S3_BUCKET; no bucket = no S3 storage
      prefix: paperline                     # PAPERLINE_S3_PREFIX
      region: us-east-1                     # AWS_REGION / AWS_DEFAULT_REGION
      remote: s3                            # the DVC remote's name
      mlflow_artifacts: true                # embedded store: new experiments log artifacts to S3

Credentials come only from the environment, as boto/s3fs read them: `AWS_ACCESS_KEY_ID` +
`AWS_SECRET_ACCESS_KEY` (+ `AWS_SESSION_TOKEN`), or `AWS_PROFILE`. They are never written to
params, `.dvc/config*`, MLflow or logs, and never passed on a command line: a params key that
looks like a credential, or an endpoint URL with `user:password@`, is refused without echoing its
value, and `setup`/`push` refuse a `.dvc/config*` that holds credentials. Error messages name the
endpoint and the bucket, never the secret.

The preflight exists because a push that fails halfway is slow to diagnose: DVC reports a wrong
secret or an unreachable endpoint as a generic error after retries. It runs before any transfer;
a push never touches the local cache, so on failure nothing local is lost.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

from .config import ParamsError, read_yaml

ENV = {  # setting -> environment variables that override params, first set wins
    "endpoint_url": ("PAPERLINE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "bucket": ("PAPERLINE_S3_BUCKET",),
    "prefix": ("PAPERLINE_S3_PREFIX",),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
}
KNOWN = ("endpoint_url", "bucket", "prefix", "region", "remote", "mlflow_artifacts")
CREDENTIAL_WORDS = ("secret", "password", "passwd", "token", "access_key", "credential")
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
DVC_CREDENTIAL_KEYS = ("access_key_id", "secret_access_key", "session_token")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


class StorageError(RuntimeError):
    """S3 is unusable (unreachable, credentials refused, no bucket): names endpoint and bucket."""


@dataclass(frozen=True)
class Settings:
    bucket: str
    endpoint_url: str | None = None   # None: AWS's own endpoint for the region
    prefix: str = "paperline"
    region: str = "us-east-1"
    remote: str = "s3"
    mlflow_artifacts: bool = True

    @property
    def where(self) -> str:
        """How messages name the store: endpoint and bucket, never a credential."""
        return f"endpoint {self.endpoint_url or 'AWS S3 (' + self.region + ')'}, bucket {self.bucket!r}"

    @property
    def dvc_url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}/dvc" if self.prefix else f"s3://{self.bucket}/dvc"

    @property
    def mlflow_artifact_root(self) -> str:
        return (f"s3://{self.bucket}/{self.prefix}/mlflow" if self.prefix
                else f"s3://{self.bucket}/mlflow")


# ---------------------------------------------------------------------------------------------
# Settings: params `storage:` + environment


def _check_endpoint(url: str, origin: str) -> str:
    parts = urlsplit(url)
    if parts.username or parts.password:  # never echo it: it holds a credential
        raise ParamsError(f"{origin} carries a user/password: credentials "
                          f"come only from the environment (AWS_ACCESS_KEY_ID / "
                          f"AWS_SECRET_ACCESS_KEY); use http(s)://host:port")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ParamsError(f"{origin} = {url!r}: expected "
                          f"http(s)://host[:port]")
    return url.rstrip("/")


def load_settings(root: Path | None = None, params: dict[str, Any] | None = None,
                  env: dict[str, str] | None = None) -> Settings | None:
    """The storage settings, or None when no bucket is configured (S3 storage off).

    `params` defaults to the root params.yaml of `root`; `env` to `os.environ`.
    """
    env = os.environ if env is None else env
    source = "params.yaml"
    if params is None:
        path = Path(root) / "params.yaml" if root is not None else None
        params = read_yaml(path) if path is not None and path.is_file() else {}
    section = params.get("storage") or {}
    if not isinstance(section, dict):
        raise ParamsError(f"{source}: storage is a {type(section).__name__}: expected a "
                          f"mapping of settings")
    for key in section:
        if any(w in str(key).lower() for w in CREDENTIAL_WORDS):
            raise ParamsError(f"{source}: storage.{key}: credentials are read only from the "
                              f"environment ({' / '.join(CREDENTIAL_ENV[:2])}); remove this key "
                              f"(its value is not shown)")
    unknown = [k for k in section if k not in KNOWN]
    if unknown:
        raise ParamsError(f"{source}: storage.{unknown[0]}: unknown key (known: {', '.join(KNOWN)})")
    values = {k: v for k, v in section.items() if v is not None and v != ""}
    origin = {k: f"{source}: storage.{k}" for k in values}  # what an error message names
    for key, names in ENV.items():
        for name in names:
            if env.get(name):
                values[key] = env[name]
                origin[key] = f"environment {name}"
                break
    if not values.get("bucket"):
        return None
    bucket = str(values["bucket"])
    if not _BUCKET.match(bucket):
        raise ParamsError(f"{origin['bucket']} = {bucket!r}: expected an S3 bucket name "
                          f"(3-63 characters: lower-case letters, digits, '.', '-')")
    endpoint = values.get("endpoint_url")
    if endpoint:
        endpoint = _check_endpoint(str(endpoint), origin["endpoint_url"])
    prefix = str(values.get("prefix", "paperline")).strip("/")
    remote = str(values.get("remote", "s3"))
    if not _NAME.match(remote):
        raise ParamsError(f"{origin['remote']} = {remote!r}: expected a plain name "
                          f"(letters, digits, '_', '-')")
    flag = values.get("mlflow_artifacts", True)
    if not isinstance(flag, bool):
        raise ParamsError(f"{origin['mlflow_artifacts']} = {flag!r}: expected true or false")
    return Settings(bucket=bucket, endpoint_url=endpoint or None, prefix=prefix,
                    region=str(values.get("region", "us-east-1")), remote=remote,
                    mlflow_artifacts=flag)


def require_settings(root: Path) -> Settings:
    settings = load_settings(root)
    if settings is None:
        raise StorageError("no S3 storage configured: set `storage.bucket` (and `endpoint_url`) "
                           "in params.yaml, or PAPERLINE_S3_BUCKET / PAPERLINE_S3_ENDPOINT_URL")
    return settings


# ---------------------------------------------------------------------------------------------
# Preflight: reach the endpoint, have the credentials accepted, find the bucket, write a probe


def _client(settings: Settings) -> Any:
    import boto3
    from botocore.config import Config

    cfg = Config(connect_timeout=3, read_timeout=10, retries={"max_attempts": 1},
                 s3={"addressing_style": "path"})  # S3-compatible stores rarely have bucket DNS
    # A session of its own: credentials resolve from the environment at this moment.
    return boto3.session.Session().client("s3", endpoint_url=settings.endpoint_url,
                                            region_name=settings.region, config=cfg)


def preflight(settings: Settings, write: bool = False) -> None:
    """Raise StorageError, naming endpoint and bucket (never a secret), unless the bucket can be
    listed (and, with `write`, a probe object written and deleted)."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
    )

    where = settings.where
    fix_creds = (f"set {' and '.join(CREDENTIAL_ENV[:2])} (or AWS_PROFILE) in the environment of "
                 f"this process")
    try:
        client = _client(settings)
        client.list_objects_v2(Bucket=settings.bucket, Prefix=f"{settings.prefix}/", MaxKeys=1)
        if write:
            key = f"{settings.prefix}/.paperline-preflight"
            client.put_object(Bucket=settings.bucket, Key=key, Body=b"ok\n")
            client.delete_object(Bucket=settings.bucket, Key=key)
    except (NoCredentialsError, PartialCredentialsError):
        raise StorageError(f"S3 ({where}): no credentials: {fix_creds}") from None
    except (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError,
            ConnectionClosedError) as exc:
        raise StorageError(f"S3 unreachable ({where}): {type(exc).__name__}: is the store running "
                           f"and the endpoint URL right (PAPERLINE_S3_ENDPOINT_URL or "
                           f"storage.endpoint_url)?") from None
    except ClientError as exc:
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        op = exc.operation_name
        if code in ("NoSuchBucket",) or status == 404:
            raise StorageError(f"S3 bucket does not exist ({where}): create it, or point "
                               f"storage.bucket / PAPERLINE_S3_BUCKET at an existing one") from None
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                    "ExpiredToken", "InvalidClientTokenId", "AuthorizationHeaderMalformed"):
            raise StorageError(f"S3 rejected the credentials ({where}): {code}: check "
                               f"{' / '.join(CREDENTIAL_ENV[:2])} in the environment") from None
        if code == "AccessDenied" or status == 403:
            what = "write to" if op in ("PutObject", "DeleteObject") else "list"
            raise StorageError(f"S3 denied access ({where}): the credentials may not {what} the "
                               f"bucket ({op}: {code or status})") from None
        raise StorageError(f"S3 error ({where}): {op}: {code or status}") from None
    except BotoCoreError as exc:
        raise StorageError(f"S3 client error ({where}): {type(exc).__name__}") from None


# ---------------------------------------------------------------------------------------------
# DVC remote


def _dvc_config(root: Path) -> Any:
    from dvc.config import Config

    return Config(dvc_dir=str(Path(root) / ".dvc"))


def credentials_in_dvc_config(root: Path) -> list[str]:
    """`<file>: remote <name>.<key>` for every credential a `.dvc/config*` file holds."""
    conf = _dvc_config(root)
    found = []
    for level in ("repo", "local"):
        remotes = conf.read(level).get("remote", {})
        for name, section in remotes.items():
            for key in DVC_CREDENTIAL_KEYS:
                if section.get(key):
                    found.append(f"{Path(conf.files[level]).relative_to(root)}: "
                                 f"remote {name!r}.{key}")
    return found


def _refuse_stored_credentials(root: Path) -> None:
    found = credentials_in_dvc_config(root)
    if found:
        raise StorageError("credentials are stored in DVC config (" + "; ".join(found) + "): "
                           "remove them (`dvc remote modify --unset`); they come only from the "
                           "environment")


def setup_remote(root: Path, settings: Settings, local: bool = False,
                 default: bool = True) -> Path:
    """Write the DVC remote (URL, endpoint, region; never credentials); returns the file written.

    `local`: `.dvc/config.local` (this machine only, e.g. a worker that reaches the store under
    another host name), else `.dvc/config` (committed, so a clone pushes and pulls as is).
    """
    _refuse_stored_credentials(root)
    conf = _dvc_config(root)
    level = "local" if local else "repo"
    with conf.edit(level) as c:
        section = dict(c["remote"].get(settings.remote, {}))
        section.update({"url": settings.dvc_url, "region": settings.region})
        if settings.endpoint_url:
            section["endpointurl"] = settings.endpoint_url
        else:
            section.pop("endpointurl", None)
        c["remote"][settings.remote] = section
        if default:
            c["core"]["remote"] = settings.remote
    return Path(conf.files[level])


def configured_remote(root: Path, name: str) -> dict[str, Any] | None:
    return _dvc_config(root).read().get("remote", {}).get(name)


def _dvc_bin() -> str:
    here = Path(sys.executable).with_name("dvc")
    return str(here) if here.exists() else (shutil.which("dvc") or "dvc")


def transfer(root: Path, direction: str, targets: Sequence[str] = (),
             settings: Settings | None = None, jobs: int | None = None) -> int:
    """`dvc push|pull --run-cache -r <remote> [targets]` after the preflight; returns DVC's code.

    Raises StorageError (before any transfer) when the store is unusable or the remote is not set
    up. Outputs and run-cache entries travel together, so a worker elsewhere restores stages
    from the run-cache instead of recomputing them.
    """
    if direction not in ("push", "pull"):
        raise ValueError(f"direction = {direction!r}: expected 'push' or 'pull'")
    root = Path(root)
    settings = settings or require_settings(root)
    _refuse_stored_credentials(root)
    remote = configured_remote(root, settings.remote)
    if not remote:
        raise StorageError(f"no DVC remote {settings.remote!r} in .dvc/config: run "
                           f"`paperline remote setup` first ({settings.where})")
    if remote.get("url", "").rstrip("/") != settings.dvc_url:
        raise StorageError(f"DVC remote {settings.remote!r} points at {remote.get('url')!r}, the "
                           f"storage settings at {settings.dvc_url!r}: run "
                           f"`paperline remote setup` to update it")
    preflight(settings, write=direction == "push")
    cmd = [_dvc_bin(), direction, "--run-cache", "-r", settings.remote,
           *(["--jobs", str(jobs)] if jobs else []), *targets]
    rc = subprocess.run(cmd, cwd=root).returncode
    if rc != 0:
        print(f"error: `dvc {direction}` with {settings.where} failed (exit {rc}); the local "
              f"cache is unchanged", file=sys.stderr)
    return rc


# ---------------------------------------------------------------------------------------------
# MLflow


def mlflow_client_env(settings: Settings) -> dict[str, str]:
    """What an MLflow process needs (besides credentials, from the environment) to reach S3."""
    env = {"AWS_DEFAULT_REGION": settings.region}
    if settings.endpoint_url:
        env["MLFLOW_S3_ENDPOINT_URL"] = settings.endpoint_url
    return env


def mlflow_server_args(settings: Settings) -> list[str]:
    """Arguments of `mlflow server` that proxy artifacts to S3: clients need no S3 credentials."""
    return ["--artifacts-destination", settings.mlflow_artifact_root]


def apply_mlflow_env(root: Path) -> Settings | None:
    """Let this process's MLflow client reach the store (`MLFLOW_S3_ENDPOINT_URL`, region) when S3
    storage is configured; values already in the environment win. Returns the settings."""
    settings = load_settings(root)
    if settings is not None:
        for key, value in mlflow_client_env(settings).items():
            os.environ.setdefault(key, value)
    return settings


def experiment_artifact_location(root: Path, pipeline: str) -> str | None:
    """For the embedded store: where a new experiment keeps its artifacts when S3 storage is on
    and `mlflow_artifacts` is true (None otherwise)."""
    settings = apply_mlflow_env(root)
    if settings is None or not settings.mlflow_artifacts:
        return None
    return f"{settings.mlflow_artifact_root}/{pipeline}"


def describe(root: Path, settings: Settings) -> str:
    remote = configured_remote(root, settings.remote) or {}
    have = [n for n in CREDENTIAL_ENV[:2] if os.environ.get(n)]
    creds = ("from the environment (" + ", ".join(have) + " set)" if have else
             "AWS_PROFILE" if os.environ.get("AWS_PROFILE") else
             "NOT set: export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    lines = [f"store:       {settings.where}",
             f"DVC remote:  {settings.remote} -> {settings.dvc_url}"
             f"{'' if remote else '  (not set up: paperline remote setup)'}",
             f"MLflow:      artifacts under {settings.mlflow_artifact_root} (MLflow server "
             f"--artifacts-destination"
             f"{'; new experiments of the embedded store' if settings.mlflow_artifacts else ''})",
             f"credentials: {creds}"]
    return "\n".join(lines)
