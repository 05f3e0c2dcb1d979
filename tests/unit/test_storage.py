"""S3 storage settings and the DVC remote config, without a server (the server tests are in
tests/stack/test_s3_storage.py): where settings come from, and that credentials are refused
everywhere except the environment, without their values ever being echoed."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.core import storage
from stages.core.config import ParamsError

SECRET = "PLANTED-SECRET-7f3a"


def test_no_bucket_means_no_s3_storage():
    assert storage.load_settings(params={}, env={}) is None
    assert storage.load_settings(params={"storage": {"endpoint_url": "http://h:1"}}, env={}) is None


def test_params_then_environment():
    params = {"storage": {"endpoint_url": "http://127.0.0.1:8333/", "bucket": "team-bucket",
                          "prefix": "/proj/"}}
    s = storage.load_settings(params=params, env={})
    assert (s.endpoint_url, s.bucket, s.prefix, s.region) == (
        "http://127.0.0.1:8333", "team-bucket", "proj", "us-east-1")
    assert s.dvc_url == "s3://team-bucket/proj/dvc"
    assert s.mlflow_artifact_root == "s3://team-bucket/proj/mlflow"
    # a worker in a container reaches the store under another name: the environment wins
    s = storage.load_settings(params=params, env={"PAPERLINE_S3_ENDPOINT_URL": "http://seaweedfs:8333",
                                                  "AWS_REGION": "eu-west-1"})
    assert (s.endpoint_url, s.region, s.bucket) == ("http://seaweedfs:8333", "eu-west-1",
                                                    "team-bucket")
    s = storage.load_settings(params={}, env={"PAPERLINE_S3_BUCKET": "from-env",
                                              "AWS_ENDPOINT_URL_S3": "https://s3.example.org"})
    assert (s.bucket, s.endpoint_url) == ("from-env", "https://s3.example.org")
    assert "https://s3.example.org" in s.where and "'from-env'" in s.where


@pytest.mark.parametrize("key", ["aws_secret_access_key", "access_key_id", "secret",
                                 "session_token", "password"])
def test_credentials_in_params_are_refused_without_echo(key):
    with pytest.raises(ParamsError, match="only from the") as exc:
        storage.load_settings(params={"storage": {"bucket": "b-1", key: SECRET}}, env={})
    assert SECRET not in str(exc.value) and f"storage.{key}" in str(exc.value)


def test_endpoint_with_user_password_is_refused_without_echo():
    url = f"http://AKIAX:{SECRET}@127.0.0.1:8333"
    with pytest.raises(ParamsError, match="user/password") as exc:
        storage.load_settings(params={"storage": {"bucket": "b-1", "endpoint_url": url}}, env={})
    assert SECRET not in str(exc.value)
    with pytest.raises(ParamsError) as exc:
        storage.load_settings(params={"storage": {"bucket": "b-1"}},
                              env={"PAPERLINE_S3_ENDPOINT_URL": url})
    assert SECRET not in str(exc.value) and "PAPERLINE_S3_ENDPOINT_URL" in str(exc.value)


@pytest.mark.parametrize("section, match", [
    ({"bucket": "Bad_Bucket"}, "storage.bucket = 'Bad_Bucket'"),
    ({"bucket": "ok-bucket", "endpoint_url": "ftp://h"}, "expected http"),
    ({"bucket": "ok-bucket", "remote": "a b"}, "storage.remote"),
    ({"bucket": "ok-bucket", "mlflow_artifacts": "yes"}, "true or false"),
    ({"bucket": "ok-bucket", "endpoint": "http://h:1"}, "unknown key"),
])
def test_bad_settings_name_key_and_rule(section, match):
    with pytest.raises(ParamsError, match=match):
        storage.load_settings(params={"storage": section}, env={})


def _dvc_repo(tmp_path: Path) -> Path:
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config").write_text("[core]\n    analytics = false\n")
    return tmp_path


def test_setup_writes_the_remote_and_no_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAPAPERLINE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    root = _dvc_repo(tmp_path)
    s = storage.Settings(bucket="team-bucket", endpoint_url="http://127.0.0.1:8333", prefix="p")
    path = storage.setup_remote(root, s)
    text = path.read_text()
    assert path == root / ".dvc" / "config"
    assert 'remote "s3"' in text and "url = s3://team-bucket/p/dvc" in text
    assert "endpointurl = http://127.0.0.1:8333" in text and "remote = s3" in text
    assert SECRET not in text and "AKIAPAPERLINE" not in text
    assert storage.configured_remote(root, "s3")["url"] == "s3://team-bucket/p/dvc"

    # --local: this machine's endpoint, shadowing the committed one
    worker = storage.Settings(bucket="team-bucket", endpoint_url="http://seaweedfs:8333",
                              prefix="p")
    local = storage.setup_remote(root, worker, local=True)
    assert local.name == "config.local" and "seaweedfs:8333" not in path.read_text()
    assert storage.configured_remote(root, "s3")["endpointurl"] == "http://seaweedfs:8333"


def test_stored_credentials_are_found_and_refused(tmp_path):
    root = _dvc_repo(tmp_path)
    (root / ".dvc" / "config.local").write_text(
        f'[\'remote "s3"\']\n    url = s3://b-1/x\n    secret_access_key = {SECRET}\n')
    found = storage.credentials_in_dvc_config(root)
    assert found == [".dvc/config.local: remote 's3'.secret_access_key"]
    s = storage.Settings(bucket="b-1", prefix="x")
    with pytest.raises(storage.StorageError, match="credentials are stored") as exc:
        storage.setup_remote(root, s)
    assert SECRET not in str(exc.value)
    with pytest.raises(storage.StorageError, match="credentials are stored"):
        storage.transfer(root, "push", settings=s)


def test_transfer_needs_a_matching_remote(tmp_path):
    root = _dvc_repo(tmp_path)
    s = storage.Settings(bucket="b-1", endpoint_url="http://127.0.0.1:9", prefix="x")
    with pytest.raises(storage.StorageError, match="paperline remote setup"):
        storage.transfer(root, "push", settings=s)
    storage.setup_remote(root, storage.Settings(bucket="b-1", prefix="other"))
    with pytest.raises(storage.StorageError, match="points at 's3://b-1/other/dvc'"):
        storage.transfer(root, "pull", settings=s)


def test_mlflow_server_and_client_settings_carry_no_credentials(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    s = storage.Settings(bucket="b-1", endpoint_url="http://127.0.0.1:8333", prefix="p")
    assert storage.mlflow_server_args(s) == ["--artifacts-destination", "s3://b-1/p/mlflow"]
    env = storage.mlflow_client_env(s)
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "http://127.0.0.1:8333"
    assert SECRET not in repr(env) + repr(storage.mlflow_server_args(s))
