"""Storage options from a file or the environment, misspelled names refused, non-atomic backends named."""

from __future__ import annotations

import logging
import os

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from deltafs.errors import UsageError
from deltafs.store.open import open_objects
from deltafs.store.options import check_option_names, resolve_storage_options
from deltafs.testing.checkpoints import run_cli


def test_sources_in_order(tmp_path):
    f = tmp_path / "opts.json"
    f.write_text('{"key": "from-file"}')
    env = {"DELTAFS_STORAGE_OPTIONS": '{"key": "from-env"}'}
    assert resolve_storage_options('{"key": "inline"}', env) == {"key": "inline"}
    assert resolve_storage_options(f"@{f}", env) == {"key": "from-file"}
    assert resolve_storage_options(None, env) == {"key": "from-env"}
    assert resolve_storage_options(None, {"DELTAFS_STORAGE_OPTIONS": f"@{f}"}) == {"key": "from-file"}
    assert resolve_storage_options(None, {}) == {}


@pytest.mark.parametrize("text,message", [
    ("[1, 2]", "must be a JSON object"),
    ("{nope", "not valid JSON"),
    ("[" * 100000, "not valid JSON"),
    ("@/nonexistent/opts.json", "not a regular file"),
])
def test_bad_options_are_one_line_usage_errors(text, message):
    with pytest.raises(UsageError, match=message):
        resolve_storage_options(text, {})


@pytest.mark.parametrize("protocol,options,ok", [
    ("s3", {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s", "client_kwargs": {}}, True),
    ("s3", {"endpont_url": "http://127.0.0.1:9"}, False),
    ("s3", {"use_listings_cache": False, "deltafs": {"attempts": 2}}, True),
    ("file", {"auto_mkdir": True}, True),
    ("file", {"auto_mkdirr": True}, False),
    ("gs", {"endpoint_url": "http://127.0.0.1:9", "token": "anon", "project": "p"}, True),
    ("gs", {"projct": "p"}, False),
])
def test_option_names_checked_for_known_backends(protocol, options, ok):
    if ok:
        check_option_names(protocol, options)
    else:
        with pytest.raises(UsageError, match="did you mean"):
            check_option_names(protocol, options)


def test_cli_reads_options_from_file_and_env_and_refuses_typos(tmp_path, maker):
    store = tmp_path / "store"
    run_cli("push", maker.write(), store, "-q", check=0)
    opts = tmp_path / "opts.json"
    opts.write_text('{"auto_mkdir": true}')
    run_cli("log", store, "--storage-options", f"@{opts}", check=0)
    bad = run_cli("log", store, env={"DELTAFS_STORAGE_OPTIONS": '{"auto_mkdirr": true}'})
    assert bad.returncode == 2 and "did you mean 'auto_mkdir'" in bad.stderr and len(bad.stderr.splitlines()) == 1


class _PlainFS(MemoryFileSystem):
    """A backend deltafs has no conditional write for (as hf://, az:// or sftp:// today)."""

    protocol = ("plainfs-test",)
    store: dict = {}
    pseudo_dirs = [""]


def test_a_backend_without_atomic_create_is_named(caplog):
    fsspec.register_implementation("plainfs-test", _PlainFS, clobber=True)
    with caplog.at_level(logging.WARNING, logger="deltafs.store"):
        open_objects("plainfs-test://bucket/store")
    assert any("plainfs-test:// has no create-if-absent write" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("url, options, message", [
    ("s3://b/run", {"endpoint_url": "not a url"}, "endpoint_url must be an http:// or https:// URL"),
    ("s3://b/run", {"endpoint_url": 5}, "endpoint_url must be an http:// or https:// URL"),
    ("s3://b/run", {"client_kwargs": "oops"}, "client_kwargs must be a JSON object"),
    ("s3://b/run", {"config_kwargs": {"retries": "many"}}, "config_kwargs.retries must be a JSON object"),
    ("s3://b/run", {"key": 123}, "key must be text"),
    ("s3://b/run", {"anon": "yes"}, "anon must be true or false"),
    ("gs://b/run", {"endpoint_url": "localhost:4443"}, "endpoint_url must be an http:// or https:// URL"),
    ("s3://b/run", {"client_kwargs": {"endpoint_url": "minio:9000"}}, "client_kwargs.endpoint_url must be"),
])
def test_storage_option_values_of_the_wrong_kind_are_usage_errors(url, options, message):
    """Each was an AttributeError or ValueError deep in botocore or gcsfs at the first request: "internal error",
    exit 1 (adversarial pass). Refused when the store is opened, exit 2, naming the option."""
    from deltafs.errors import UsageError
    from deltafs.store.open import open_objects

    with pytest.raises(UsageError, match=message):
        open_objects(url, options)


@pytest.mark.parametrize("url, message", [
    ("s3:/bkt/run", "is not a valid s3:// URL .* write s3://bkt/run"),
    ("gs:/bkt/run", "is not a valid gs:// URL"),
    ("s3://", "names no bucket"),
])
def test_store_urls_that_are_almost_right_are_refused(url, message, tmp_path, monkeypatch):
    """`push SRC s3:/bkt/run` made a local store in ./s3:/bkt/run and exited 0; `s3://` failed in botocore's
    parameter validation (exit 3). Both are usage errors naming the fix, and nothing is created."""
    from deltafs.errors import UsageError
    from deltafs.store.open import open_objects

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=message):
        open_objects(url, {})
    assert not os.listdir(tmp_path)



def test_storage_option_values_that_backends_accept_still_pass():
    """null for an object option (s3fs's own default), a numeric GCS project, a token object for GCS."""
    from deltafs.store.options import check_option_values

    check_option_values("s3", {"config_kwargs": None, "client_kwargs": None, "endpoint_url": "http://127.0.0.1:9000",
                               "client_kwargs_extra": None})
    check_option_values("gs", {"project": 12345, "token": {"type": "service_account"}, "endpoint_url": "https://x"})
