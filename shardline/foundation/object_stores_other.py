"""Conditional writes on GCS, Azure Blob (ABFS) and HDFS. NEVER RAN HERE: no such service is
reachable from the machine shardline is developed on. Written from each SDK's documented
conditional requests; docs/storage.md says what each step guarantees.

- GCS: an object's generation is its tag; `if_generation_match=0` creates only,
  `if_generation_match=<generation>` replaces or deletes only that generation.
- Azure Blob: the ETag is the tag; `overwrite=False` creates only, `etag=` with
  `MatchConditions.IfNotModified` replaces or deletes only an unchanged blob.
- HDFS: rename(2) semantics: a rename onto an existing file fails, so a temp file
  renamed to the final name creates only. HDFS has no compare-and-swap: `replace_if`
  is refused (a lease there cannot be taken over; its holder's release deletes it).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import uuid

import pyarrow.fs as pafs

from .errors import StorageError

# Imported inside the functions that use them: foundation.object_stores (a cycle: it imports this module).


def _need(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise StorageError(f"conditional writes on this store need the {package} package (pip install {package})") from None


def _bucket_key(url: str) -> tuple[str, str]:
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    return bucket, key


class Gcs:
    @staticmethod
    def _blob(url: str):
        gcs = _need("google.cloud.storage", "google-cloud-storage")
        bucket, key = _bucket_key(url)
        return gcs.Client().bucket(bucket).blob(key)

    @staticmethod
    def _precondition():
        return _need("google.api_core.exceptions", "google-cloud-storage").PreconditionFailed

    @classmethod
    def create_only(cls, url: str, data: bytes) -> str | None:
        blob = cls._blob(url)
        try:
            blob.upload_from_string(data, if_generation_match=0)
        except cls._precondition():
            return None
        return str(blob.generation)

    @classmethod
    def read_tagged(cls, url: str) -> tuple[bytes, str] | None:
        gcs = _need("google.cloud.storage", "google-cloud-storage")
        bucket, key = _bucket_key(url)
        blob = gcs.Client().bucket(bucket).get_blob(key)
        if blob is None:
            return None
        try:
            return blob.download_as_bytes(if_generation_match=blob.generation), str(blob.generation)
        except cls._precondition():  # replaced between the two requests: read again
            return cls.read_tagged(url)

    @classmethod
    def replace_if(cls, url: str, data: bytes, tag: str) -> str | None:
        blob = cls._blob(url)
        try:
            blob.upload_from_string(data, if_generation_match=int(tag))
        except cls._precondition():
            return None
        return str(blob.generation)

    @classmethod
    def delete_if(cls, url: str, tag: str) -> bool:
        nf = _need("google.api_core.exceptions", "google-cloud-storage").NotFound
        try:
            cls._blob(url).delete(if_generation_match=int(tag))
        except (cls._precondition(), nf):
            return False
        return True


class Abfs:
    @staticmethod
    def _client(url: str):
        blob = _need("azure.storage.blob", "azure-storage-blob")
        rest = url.split("://", 1)[1]
        container_at_account, _, key = rest.partition("/")
        container, _, host = container_at_account.partition("@")
        account = host.split(".", 1)[0]
        conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        if conn:
            service = blob.BlobServiceClient.from_connection_string(conn)
        else:
            identity = _need("azure.identity", "azure-identity")
            service = blob.BlobServiceClient(
                f"https://{account}.blob.core.windows.net", credential=identity.DefaultAzureCredential()
            )
        return service.get_blob_client(container, key)

    @staticmethod
    def _errors():
        return _need("azure.core.exceptions", "azure-core")

    @classmethod
    def create_only(cls, url: str, data: bytes) -> str | None:
        try:
            return cls._client(url).upload_blob(data, overwrite=False)["etag"]
        except cls._errors().ResourceExistsError:
            return None

    @classmethod
    def read_tagged(cls, url: str) -> tuple[bytes, str] | None:
        try:
            d = cls._client(url).download_blob()
        except cls._errors().ResourceNotFoundError:
            return None
        return d.readall(), d.properties.etag

    @classmethod
    def replace_if(cls, url: str, data: bytes, tag: str) -> str | None:
        core = _need("azure.core", "azure-core")
        err = cls._errors()
        try:
            r = cls._client(url).upload_blob(
                data, overwrite=True, etag=tag, match_condition=core.MatchConditions.IfNotModified
            )
        except (err.ResourceModifiedError, err.ResourceNotFoundError):
            return None
        return r["etag"]

    @classmethod
    def delete_if(cls, url: str, tag: str) -> bool:
        core = _need("azure.core", "azure-core")
        err = cls._errors()
        try:
            cls._client(url).delete_blob(etag=tag, match_condition=core.MatchConditions.IfNotModified)
        except (err.ResourceModifiedError, err.ResourceNotFoundError):
            return False
        return True


class Hdfs:
    @staticmethod
    def _fs(url: str):
        from .object_stores import filesystem

        return filesystem(url)

    @classmethod
    def create_only(cls, url: str, data: bytes) -> str | None:
        fs, path = cls._fs(url)
        tmp = f"{path.rsplit('/', 1)[0]}/.{path.rsplit('/', 1)[-1]}.{uuid.uuid4().hex[:8]}.tmp"
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        try:
            fs.move(tmp, path)  # HDFS refuses to rename onto an existing file
        except OSError:
            fs.delete_file(tmp)
            if fs.get_file_info(path).type != pafs.FileType.NotFound:
                return None
            raise
        return hashlib.sha256(data).hexdigest()

    @classmethod
    def read_tagged(cls, url: str) -> tuple[bytes, str] | None:
        fs, path = cls._fs(url)
        try:
            with fs.open_input_stream(path) as f:
                data = f.readall()
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    @classmethod
    def replace_if(cls, url: str, data: bytes, tag: str) -> str | None:
        raise StorageError(
            f"{url}: HDFS has no compare-and-swap, so an expired lease cannot be taken over "
            f"safely; check that its holder is gone and delete the file"
        )

    @classmethod
    def delete_if(cls, url: str, tag: str) -> bool:
        # Not atomic: between the read and the delete the object could change. Only a
        # lease's own holder deletes it, and on HDFS nobody else can replace it.
        current = cls.read_tagged(url)
        if current is None or current[1] != tag:
            return False
        fs, path = cls._fs(url)
        fs.delete_file(path)
        return True
