"""``s3``: objects in any S3-compatible object store, through boto3.

- One object per kvtier object under ``{prefix}{ObjectKey.to_str()}`` in
  ``bucket``: the model and the tenant salt are in every key. Its body is the
  shared object format (header, then payload), checked on every load; a bad
  copy is a miss and is deleted.
- Credentials: ``access_key_id``/``secret_access_key`` when given, else the
  usual AWS chain (environment, shared files, instance roles).
- Transfers: a store or load batch is split across the adapter's I/O threads
  (``io_threads``, 8 by default); a lookup of many keys sends parallel HEADs,
  at most ``lookup_concurrency`` at a time, so a batch costs about one round
  trip, not one per chunk.
- boto3's own checksums are off (``when_required``): they halve GET speed,
  and kvtier checks its own.
- An unreachable endpoint or a timeout fails the batch (back-off); a missing
  object is a miss (``not_found``); other errors are counted per key.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier.keys import KeySelector, ObjectKey
from kvtier.l2.base import AdapterConfig, Buffer, CompletionCallback, PurgeStep
from kvtier.l2.blocking import BackendUnavailable, BlockingAdapter
from kvtier.l2.format import (
    Corruption,
    CorruptObject,
    stored_bound,
)
from kvtier.l2.stored_value import decode_object, encode_object

log = logging.getLogger(__name__)

MISSING = {"404", "NoSuchKey", "NotFound"}


@dataclass(frozen=True, slots=True, kw_only=True)
class S3Config(AdapterConfig):
    bucket: str
    io_threads: int = 8
    prefix: str = "kvtier/"
    endpoint_url: str = ""  # "": AWS
    region: str = ""
    access_key_id: str = ""  # "": the usual AWS credential chain
    secret_access_key: str = ""
    lookup_concurrency: int = 16
    create_bucket: bool = False  # create it at start if it is missing

    def __post_init__(self) -> None:
        super(S3Config, self).__post_init__()
        if not self.bucket:
            raise ValueError("option 'bucket' must name the S3 bucket")
        if self.lookup_concurrency <= 0:
            raise ValueError("option 'lookup_concurrency' must be positive")
        if bool(self.access_key_id) != bool(self.secret_access_key):
            raise ValueError("give both 'access_key_id' and 'secret_access_key', or neither")


class S3Adapter(BlockingAdapter):
    type_name = "s3"
    config_class = S3Config

    def __init__(self, config: S3Config, on_complete: CompletionCallback) -> None:
        import boto3
        import botocore.config
        import botocore.exceptions

        super().__init__(config, on_complete)
        self.s3_config = config
        self._client_error = botocore.exceptions.ClientError
        self._unreachable: tuple[type[BaseException], ...] = (
            botocore.exceptions.EndpointConnectionError,
            botocore.exceptions.ConnectionClosedError,
            botocore.exceptions.ConnectTimeoutError,
        )
        self._timeouts: tuple[type[BaseException], ...] = (botocore.exceptions.ReadTimeoutError,)
        options: dict[str, Any] = {
            "config": botocore.config.Config(
                connect_timeout=config.timeout_s,
                read_timeout=config.timeout_s,
                retries={"max_attempts": 1, "mode": "standard"},
                max_pool_connections=config.io_threads + config.lookup_concurrency,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            )
        }
        if config.endpoint_url:
            options["endpoint_url"] = config.endpoint_url
        if config.region:
            options["region_name"] = config.region
        if config.access_key_id:
            options["aws_access_key_id"] = config.access_key_id
            options["aws_secret_access_key"] = config.secret_access_key
        self._s3: Any = boto3.session.Session().client("s3", **options)
        self._heads = ThreadPoolExecutor(
            config.lookup_concurrency, thread_name_prefix=f"l2-{self.name}-head"
        )
        if config.create_bucket:
            self._ensure_bucket()

    def name_of(self, key: ObjectKey) -> str:
        """The object name of ``key`` in the bucket."""
        return self.s3_config.prefix + key.to_str()

    # ----------------------------------------------------------- backend

    def _store(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[int | None]:
        written: list[int | None] = []
        for key, buffer in zip(keys, buffers, strict=True):
            body = encode_object(key, layout, buffer, self.codec, self.seal)
            ok = self._call(
                key, "put_object", Bucket=self.s3_config.bucket, Key=self.name_of(key), Body=body
            )
            written.append(len(body) if ok is not None else None)
        return written

    def _lookup(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if len(keys) <= 1:
            return [self._head(k) for k in keys]
        return list(self._heads.map(self._head, keys))

    def _load(
        self, keys: Sequence[ObjectKey], buffers: Sequence[Buffer], layout: str
    ) -> list[bool]:
        loaded = []
        for key, buffer in zip(keys, buffers, strict=True):
            reply = self._call(
                key, "get_object", Bucket=self.s3_config.bucket, Key=self.name_of(key)
            )
            if reply is None:
                loaded.append(False)
                continue
            body, bound = reply["Body"], stored_bound(buffer.nbytes)
            try:
                # Read no more than any copy of this object can take, whatever
                # another writer of the bucket stored under its name.
                if int(reply.get("ContentLength", 0)) > bound:
                    body.close()
                    raise CorruptObject(Corruption.LENGTH, "longer than any copy of this object")
                decode_object(body.read(bound + 1), key, layout, buffer, self.codec, self.seal)
            except CorruptObject as error:
                self._corrupt(key, error)
                self._call(
                    key,
                    "delete_object",
                    quiet=True,
                    Bucket=self.s3_config.bucket,
                    Key=self.name_of(key),
                )
                loaded.append(False)
                continue
            loaded.append(True)
        return loaded

    def _reconnect(self) -> None:
        try:
            self._s3.head_bucket(Bucket=self.s3_config.bucket)
        except self._unreachable + self._timeouts as exc:
            raise BackendUnavailable(str(exc)) from exc

    def _close_backend(self) -> None:
        self._heads.shutdown(wait=True)
        self._s3.close()

    def _backend_status(self) -> dict[str, object]:
        c = self.s3_config
        return {"endpoint": c.endpoint_url or "aws", "bucket": c.bucket, "prefix": c.prefix}

    def purge(self, selector: KeySelector, cursor: str | None, limit: int) -> PurgeStep:
        """One listing page under the selector's prefix, its matches deleted
        (``delete_objects``, up to 1,000 a call)."""
        c = self.s3_config
        params: dict[str, Any] = {
            "Bucket": c.bucket,
            "Prefix": c.prefix + selector.prefix,
            "MaxKeys": min(limit, 1000),
        }
        if cursor:
            params["ContinuationToken"] = cursor
        try:
            page = self._s3.list_objects_v2(**params)
            names = [
                o["Key"]
                for o in page.get("Contents", [])
                if _matches(selector, o["Key"].removeprefix(c.prefix))
            ]
            if names:
                self._s3.delete_objects(
                    Bucket=c.bucket, Delete={"Objects": [{"Key": n} for n in names], "Quiet": True}
                )
        except self._timeouts as exc:
            raise TimeoutError(str(exc)) from exc
        except self._unreachable as exc:
            raise BackendUnavailable(str(exc)) from exc
        after = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        return PurgeStep(len(names), after)

    # --------------------------------------------------------- internals

    def _head(self, key: ObjectKey) -> bool:
        found = self._call(
            key, "head_object", Bucket=self.s3_config.bucket, Key=self.name_of(key), quiet=True
        )
        return found is not None

    def _call(self, key: ObjectKey, operation: str, quiet: bool = False, **params: Any) -> Any:
        """One S3 call for one key: its reply, or None for a miss (counted,
        unless ``quiet``). The backend being away raises for the batch."""
        try:
            return getattr(self._s3, operation)(**params)
        except self._timeouts as exc:
            raise TimeoutError(str(exc)) from exc
        except self._unreachable as exc:
            raise BackendUnavailable(str(exc)) from exc
        except self._client_error as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in MISSING:
                if not quiet:
                    self._count_failure("not_found")
                return None
            log.warning("L2 %s: %s of %s failed: %s", self.name, operation, key, exc)
            self._count_failure("permission" if code in ("403", "AccessDenied") else "error")
            return None

    def _ensure_bucket(self) -> None:
        try:
            self._s3.head_bucket(Bucket=self.s3_config.bucket)
        except self._client_error:
            self._s3.create_bucket(Bucket=self.s3_config.bucket)


def _matches(selector: KeySelector, name: str) -> bool:
    try:
        return selector.matches(ObjectKey.from_str(name))
    except ValueError:  # not one of kvtier's objects
        return False
