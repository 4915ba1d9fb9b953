"""The object stores behind `foundation.storage`: filesystems, one-shot uploads, conditional writes.

S3 (and anything speaking its API: MinIO, Ceph, GCS's XML API, moto) is the one
exercised here: reads through `pyarrow.fs.S3FileSystem`, uploads and conditional
requests through boto3 (`IfNoneMatch="*"` creates only, `IfMatch=<etag>` replaces
or deletes only an unchanged object). Both take endpoint, region and credentials
from the standard AWS chain (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ~/.aws/...):
nothing about a store is ever in shardline's config.

gs://, abfs:// and hdfs:// are written from their SDKs' documented conditional
requests and never ran here (no such service is reachable); docs/storage.md says
what each guarantees.
"""

from __future__ import annotations

import os
import threading
from typing import IO
from urllib.parse import urlsplit

from .errors import StorageError, first_line

_CACHE: dict[tuple, object] = {}
_LOCK = threading.RLock()
# A probe PUT that can never succeed: it is authorised (or not) before its
# precondition fails, so it tells write access without writing anything.
_NEVER_ETAG = '"' + "0" * 32 + '"'


def _cached(key: tuple, make):
    # Per process: SDK clients must not cross a fork (Spark forks its Python workers).
    key = (os.getpid(), *key)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = make()
        return _CACHE[key]


def forget_clients() -> None:
    """Drop cached clients and filesystems: the next ones read the AWS chain anew."""
    with _LOCK:
        _CACHE.clear()


def split(url: str) -> tuple[str, str]:
    """(bucket or container, key) of an object store URL."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    return bucket, key.strip("/")


def filesystem(url: str):
    import pyarrow.fs as pafs

    scheme = url.split("://", 1)[0].lower()
    bucket, key = split(url)
    if scheme == "s3":
        return _cached(("s3fs", bucket), lambda: _s3_filesystem(bucket)), f"{bucket}/{key}".rstrip("/")
    fs, path = pafs.FileSystem.from_uri(url)
    return _cached(("fs", scheme, bucket), lambda: fs), path


# -- S3 ---------------------------------------------------------------------------


def s3_client(check: bool = False):
    """boto3's S3 client from the standard chain. check: few retries, short timeouts
    (a preflight answers in seconds; a task's client retries transient errors)."""

    def make():
        import boto3
        from botocore.config import Config

        retries = {"max_attempts": 2 if check else 5, "mode": "standard"}
        cfg = Config(connect_timeout=3 if check else 10, read_timeout=10 if check else 60, retries=retries)
        return boto3.session.Session().client("s3", config=cfg)

    return _cached(("boto3", check), make)


def _custom_endpoint() -> str | None:
    url = s3_client().meta.endpoint_url
    return None if "amazonaws.com" in url else url


def _s3_filesystem(bucket: str):
    import pyarrow.fs as pafs

    endpoint = _custom_endpoint()
    region = s3_client().meta.region_name or "us-east-1"
    kwargs = {"connect_timeout": 10, "request_timeout": 60}
    if endpoint:
        kwargs.update(endpoint_override=endpoint, scheme=endpoint.split("://", 1)[0])
    else:
        try:
            region = pafs.resolve_s3_region(bucket)
        except OSError:
            pass  # check_access names the real problem; keep the configured region
    return pafs.S3FileSystem(region=region, **kwargs)


def _code(e) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))


def _conditional(call) -> dict | None:
    """Run a conditional S3 request: its response, or None when the precondition failed."""
    from botocore.exceptions import ClientError

    for _ in range(5):
        try:
            return call()
        except ClientError as e:
            code = _code(e)
            if code == "ConditionalRequestConflict":  # 409: another conditional write in flight
                continue
            if code in ("PreconditionFailed", "412", "NoSuchKey", "404"):
                return None
            raise
    return None


def upload(url: str, f: IO[bytes]) -> None:
    scheme = url.split("://", 1)[0].lower()
    if scheme == "s3":
        bucket, key = split(url)
        # boto3's managed transfer: one PUT, or a multipart upload it aborts on failure.
        s3_client().upload_fileobj(f, bucket, key)
        return
    fs, path = filesystem(url)
    with fs.open_output_stream(path) as out:
        while chunk := f.read(8 << 20):
            out.write(chunk)


def create_only(url: str, data: bytes) -> str | None:
    store = _store(url)
    if store == "s3":
        bucket, key = split(url)
        r = _conditional(lambda: s3_client().put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*"))
        return r and r["ETag"]
    return _other(store).create_only(url, data)


def read_tagged(url: str) -> tuple[bytes, str] | None:
    store = _store(url)
    if store == "s3":
        from botocore.exceptions import ClientError

        bucket, key = split(url)
        try:
            r = s3_client().get_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if _code(e) in ("NoSuchKey", "404"):
                return None
            raise
        return r["Body"].read(), r["ETag"]
    return _other(store).read_tagged(url)


def replace_if(url: str, data: bytes, tag: str) -> str | None:
    store = _store(url)
    if store == "s3":
        bucket, key = split(url)
        r = _conditional(lambda: s3_client().put_object(Bucket=bucket, Key=key, Body=data, IfMatch=tag))
        return r and r["ETag"]
    return _other(store).replace_if(url, data, tag)


def delete_if(url: str, tag: str) -> bool:
    store = _store(url)
    if store == "s3":
        bucket, key = split(url)
        return _conditional(lambda: s3_client().delete_object(Bucket=bucket, Key=key, IfMatch=tag)) is not None
    return _other(store).delete_if(url, tag)


def _store(url: str) -> str:
    scheme = url.split("://", 1)[0].lower()
    return {"gcs": "gs", "abfss": "abfs"}.get(scheme, scheme)


def _other(store: str):
    from . import object_stores_other

    return {"gs": object_stores_other.Gcs, "abfs": object_stores_other.Abfs, "hdfs": object_stores_other.Hdfs}[store]


# -- one-line diagnoses, before anything starts ---------------------------------------


def check_access(url: str, setting: str, write: bool) -> None:
    if _store(url) != "s3":
        _check_with_pyarrow(url, setting)
        return
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    client = s3_client(check=True)
    bucket, key = split(url)
    where = f"{setting}: {url}"
    _check_endpoint(where, client.meta.endpoint_url)
    try:
        client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
        if write:
            probe = f"{key}/_shardline-write-check".lstrip("/")
            try:
                client.put_object(Bucket=bucket, Key=probe, Body=b"", IfMatch=_NEVER_ETAG)
            except ClientError as e:
                if _code(e) not in ("NoSuchKey", "404", "PreconditionFailed", "412"):
                    raise
    except NoCredentialsError:
        raise StorageError(
            f"{where}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
            f"AWS_SECRET_ACCESS_KEY, or a profile in ~/.aws/credentials)"
        ) from None
    except ClientError as e:
        raise StorageError(f"{where}: {_explain_client_error(e, bucket, write)}") from None
    except BotoCoreError as e:  # connection refused, DNS, timeouts
        endpoint = client.meta.endpoint_url
        raise StorageError(
            f"{where}: cannot reach the S3 endpoint {endpoint} ({first_line(e)}); "
            f"check AWS_ENDPOINT_URL and the network"
        ) from None


def _check_endpoint(where: str, endpoint: str) -> None:
    """An endpoint with a user part (`http://TOKEN@host:port`): boto3 sends requests past it,
    but pyarrow's S3 client refuses it on the first read ("Invalid DNS Label found in URI
    host", a 50-line traceback from inside a stage). Said here, once, masked."""
    if urlsplit(endpoint).username is not None:
        raise StorageError(
            f"{where}: the S3 endpoint {endpoint} (AWS_ENDPOINT_URL) has a user part (user@host), which "
            f"S3 clients cannot use; give the endpoint as http(s)://host:port and the credentials in "
            f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )


def _explain_client_error(e, bucket: str, write: bool) -> str:
    code = _code(e)
    op = e.operation_name if hasattr(e, "operation_name") else ""
    if code in ("NoSuchBucket",):
        return f"bucket '{bucket}' does not exist"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"):
        return f"the AWS credentials were rejected ({code}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    if code in ("AccessDenied", "403", "AllAccessDisabled"):
        what = "write" if write and op == "PutObject" else "list"
        return f"access denied: these credentials may not {what} here"
    return f"{code or 'error'}: {first_line(e)}"


def _check_with_pyarrow(url: str, setting: str) -> None:
    import pyarrow.fs as pafs

    try:
        fs, path = filesystem(url)
        fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except Exception as e:  # SDK-specific errors: name the first line
        raise StorageError(f"{setting}: {url}: not reachable ({first_line(e)})") from None
