"""S3 (and S3-compatible stores) through s3fs, with a commit marker that holds without rename.

* A file is put whole: one PUT below two parts, else a multipart upload whose parts go up
  concurrently and which is completed only after every part succeeded (s3fs aborts it on a
  failure; an upload cut off by the deadline is aborted by garbage collection). `fs.open(path,
  "wb")` is never used: its error path can still publish a partial object.
* The marker is put with ``If-None-Match: *``. A conditional PUT whose response was lost is
  retried by the client and then answered "precondition failed" for its own success, so on any
  error the marker is read back: our bytes (which carry a unique nonce) mean success, other
  bytes mean another writer committed first.
* Listings bypass s3fs's listing cache.
* Every call has a deadline: botocore's timeouts do not bound a PUT waiting for "100 Continue"
  from a stopped server (seen here: a paused server held a 10 kB PUT for over a minute).
* Credentials come from the standard places (environment incl. AWS_ENDPOINT_URL, profiles,
  `storage_options`) and never appear in repr, errors or the manifest; those given in
  `storage_options` or the AWS_* environment are redacted from every log record, botocore's
  DEBUG request dumps included (redact.py).
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import logging
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from distckpt.errors import CheckpointExistsError, ConfigError, MissingFileError, StorageError, shown
from distckpt.storage.clients import shared_client
from distckpt.storage.conditional import ConditionalCreateStorage
from distckpt.storage.fsspec_fs import _join
from distckpt.storage.registry import BackendSpec, register_backend
from distckpt.storage.spill import SpillError, check_spill_dir, default_spill_dir, write_at

if TYPE_CHECKING:
    from distckpt.storage.s3_crt import CrtReader

log = logging.getLogger("distckpt")

MAX_ATTEMPTS = 4
DEFAULT_CONFIG = {"connect_timeout": 10, "read_timeout": 60,
                  "retries": {"max_attempts": MAX_ATTEMPTS, "mode": "standard"}}
DEFAULT_PART_BYTES = 8 * 2**20   # bench/profile_s3.py: see the README's S3 notes
# Ranged GETs of a large object on load, `concurrency` at a time, streamed: 256 MiB read in
# 0.56 s with 8 MiB ranges, 0.58 s with 32 MiB, holding 3 MiB either way; a retry repeats at most
# the rest of one range.
DEFAULT_RANGE_BYTES = 8 * 2**20
DEFAULT_CONCURRENCY = 8
STREAM_PIECE_BYTES = 2**20  # a ranged GET's body is handed on in pieces of this size
DEFAULT_CALL_TIMEOUT_S = 120.0
MIN_THROUGHPUT_BYTES_S = 8 * 2**20  # a call may also take size / this long
PARTS_PER_SIZE = 1000
MIN_PART_BYTES, MAX_PART_BYTES = 5 * 2**20, 5 * 2**30  # S3: parts of 5 MiB to 5 GiB, at most 10,000


class S3Storage(ConditionalCreateStorage):
    """Checkpoints under s3://bucket/prefix.

    Extra `storage_options` (all optional): ``part_bytes`` (size of the first 1000 multipart
    parts, at least 5 MiB; later ones double every 1000), ``range_bytes`` (ranged GETs on load),
    ``concurrency`` (parts in flight), ``call_timeout`` (seconds a call may take, plus
    size / 8 MiB/s), ``retries`` (s3fs's retries on top of botocore's ``config_kwargs``),
    ``spill_dir`` (where a large file is downloaded before it is loaded, see spill.py; default
    the system's temporary directory, None to hold downloads in memory), ``client`` ("s3fs"
    or "crt": which client reads payload files, see s3_crt.py).
    """

    CAPABILITIES = dataclasses.replace(ConditionalCreateStorage.CAPABILITIES, streamed_writes=True)  # multipart

    def __init__(self, fs: Any, root: str, url: str, part_bytes: int = DEFAULT_PART_BYTES,
                 concurrency: int = DEFAULT_CONCURRENCY, call_timeout: float = DEFAULT_CALL_TIMEOUT_S,
                 range_bytes: int = DEFAULT_RANGE_BYTES, spill_dir: str | None = None,
                 crt: CrtReader | None = None) -> None:
        super().__init__(fs, root, url)
        if part_bytes < MIN_PART_BYTES:
            raise ConfigError(f"part_bytes={part_bytes} is below S3's smallest multipart part (5 MiB = "
                             f"{MIN_PART_BYTES} bytes); pass at least that in storage_options")
        self.part_bytes, self.concurrency, self.call_timeout = part_bytes, concurrency, call_timeout
        self.range_bytes, self.spill_dir, self.crt = range_bytes, spill_dir, crt

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any]) -> "S3Storage":
        import s3fs

        from distckpt.storage.s3_crt import CrtReader, choose_client  # its spec builds on this module's

        options = dict(storage_options)
        part_bytes = _number(options, "part_bytes", DEFAULT_PART_BYTES, int, 1)
        concurrency = _number(options, "concurrency", DEFAULT_CONCURRENCY, int, 1, 1024)
        call_timeout = _number(options, "call_timeout", DEFAULT_CALL_TIMEOUT_S, float, 1e-3)
        range_bytes = _number(options, "range_bytes", DEFAULT_RANGE_BYTES, int, 64 * 1024)
        retries = _number(options, "retries", 3, int, 1, 100)
        spill_dir = check_spill_dir(options.pop("spill_dir", default_spill_dir()))
        crt = CrtReader(options, MAX_ATTEMPTS) if choose_client(options.pop("client", "s3fs"), options) else None
        # A deep copy: botocore rewrites the "retries" dict it is given (max_attempts becomes
        # total_max_attempts), which left every later client with its default retries.
        config = copy.deepcopy({**DEFAULT_CONFIG, **options.pop("config_kwargs", {})})
        options.setdefault("skip_instance_cache", True)  # shared by distckpt's rule, not fsspec's (clients.py)

        def make() -> Any:
            fs = s3fs.S3FileSystem(config_kwargs=config, **options)
            fs.retries = retries  # s3fs's own retries, on top of botocore's: keep the product bounded
            return fs

        fs = shared_client("s3", {**options, "config_kwargs": config, "retries": retries}, make)
        root = url.split("://", 1)[1].rstrip("/")
        return cls(fs, root, url, part_bytes, concurrency, call_timeout, range_bytes, spill_dir, crt)

    def _call(self, what: str, target: str, method: str, *args: Any, size: int = 0, **kwargs: Any) -> Any:
        deadline = self.call_timeout + size / MIN_THROUGHPUT_BYTES_S
        try:
            return super()._call(what, target, method, *args, timeout=deadline, **kwargs)
        except _client_errors() as e:  # what s3fs leaves untranslated (connection refused …)
            raise StorageError(errno.EIO, f"{what} {self.public(target)} failed: {type(e).__name__}: {e}") from e
        except StorageError as e:
            if isinstance(e.__cause__, TimeoutError):
                raise StorageError(errno.ETIMEDOUT, f"{what} {self.public(target)} took longer than "
                                   f"{deadline:.0f}s: the S3 server is unreachable, stopped or too slow") from e.__cause__
            raise

    def write_file(self, path: str, chunks: Iterable[memoryview | bytes]) -> None:
        """Stream the chunks up in parts; at most `concurrency` parts are in memory and in flight
        (8 x 8 MiB by default; parts double every 1000, so a 100 GiB file ends with 64 MiB parts).

        Below two parts: one PUT. Otherwise a multipart upload, completed after every part
        succeeded and aborted on any failure, so the object appears whole or not at all.
        """
        from fsspec.asyn import sync

        target = _join(self.root, path)
        bucket, _, key = target.partition("/")
        try:
            sync(self.fs.loop, self._put_streaming, bucket, key, chunks)
        except _client_errors() as e:
            raise StorageError(errno.EIO, f"writing {self.public(target)} failed: {type(e).__name__}: {e}") from e
        except TimeoutError as e:
            raise StorageError(errno.ETIMEDOUT, f"writing {self.public(target)}: a request took longer than "
                               f"{self._part_deadline():.0f}s: the S3 server is unreachable, stopped or too slow") from e
        except OSError as e:
            raise StorageError(e.errno or errno.EIO, f"writing {self.public(target)} failed: {type(e).__name__}: {e}") from e
        self.fs.invalidate_cache(target)

    def _read_in_memory(self, path: str, target: str, size: int) -> bytes | bytearray | memoryview:
        """Without a download file: `concurrency` ranged GETs of `range_bytes` at a time into one
        buffer (one GET stream ran at ~125 MiB/s here, the whole load's cost). The download file
        (read_buffer) is filled the same way, or by the CRT client when it is used."""
        if size < 2 * self.range_bytes:
            return self.read_bytes(path)
        buf = bytearray(size)
        self._reading(target, self._fetch_ranges, target, size, lambda start, data: buf.__setitem__(
            slice(start, start + len(data)), data))
        return buf

    def _reading(self, target: str, run: Any, *args: Any) -> Any:
        """`run(*args)` with the store's errors as StorageError / MissingFileError."""
        try:
            return run(*args)
        except (StorageError, SpillError):
            raise
        except FileNotFoundError as e:
            raise MissingFileError(errno.ENOENT, f"{self.public(target)} does not exist") from e
        except (TimeoutError, OSError, *_client_errors()) as e:  # type: ignore[misc]  # a tuple of classes
            raise StorageError(getattr(e, "errno", None) or errno.EIO,
                               f"reading {self.public(target)} failed: {type(e).__name__}: {e}") from e

    def _download(self, target: str, size: int, fd: int) -> None:
        if self.crt is not None:
            bucket, _, key = target.partition("/")
            self.crt.download(bucket, key, size, fd, self._part_deadline(size), self.public(target))
        else:
            self._fetch_ranges(target, size, lambda start, data: write_at(fd, data, start))

    def read_range(self, path: str, start: int, end: int, put: Any) -> None:
        """Bytes [start, end) of `path` to `put(offset, data)`: the concurrent ranged GETs of a
        whole file's read, over a part of it (a cooperative load's part)."""
        target = _join(self.root, path)
        self._reading(target, self._fetch_ranges, target, end, put, start)

    def _fetch_ranges(self, target: str, size: int, put: Any, first: int = 0) -> None:
        from fsspec.asyn import sync

        sync(self.fs.loop, self._get_ranges, target, size, put, first)

    async def _get_ranges(self, target: str, size: int, put: Any, first: int = 0) -> None:
        """Concurrent ranged GETs, `concurrency` at a time, each streamed to `put(offset, data)`
        in pieces of STREAM_PIECE_BYTES as they arrive: what is held is a piece per range in
        flight. (Each range read whole, as s3fs's cat does, held up to twice the range: 8 x 8 MiB
        ranges peaked at 135 MiB over the file's mapping.)"""
        import asyncio

        slots = asyncio.Semaphore(self.concurrency)
        bucket, _, key = target.partition("/")

        async def fetch(start: int) -> None:
            end = min(size, start + self.range_bytes)
            async with slots:
                await asyncio.wait_for(self._stream_range(bucket, key, start, end, put),
                                       self._part_deadline(end - start))

        tasks = [asyncio.ensure_future(fetch(start)) for start in range(first, size, self.range_bytes)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # gather does not stop the other ranges when one fails: left running, they went on
            # writing at the download file's descriptor number after the caller had closed it,
            # into whatever file got that number next (the fallback step's download).
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _stream_range(self, bucket: str, key: str, start: int, end: int, put: Any) -> None:
        """One range with s3fs's retries; a retry after a broken stream asks for the rest only."""
        from s3fs.core import _error_wrapper

        done = start

        async def get_and_stream() -> None:
            nonlocal done
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={done}-{end - 1}")
            body = response["Body"]
            try:
                while done < end:
                    piece = await body.read(min(STREAM_PIECE_BYTES, end - done))
                    if not piece:
                        raise OSError(errno.EIO, f"short read: {done - start} of {end - start} bytes at {start}")
                    put(done, piece)
                    done += len(piece)
            finally:
                body.close()

        await _error_wrapper(get_and_stream, retries=self.fs.retries)

    def _part_deadline(self, size: int = 0) -> float:
        return self.call_timeout + max(size, self.part_bytes) / MIN_THROUGHPUT_BYTES_S

    async def _s3(self, method: str, size: int = 0, **kwargs: Any) -> Any:
        import asyncio

        return await asyncio.wait_for(self.fs._call_s3(method, **kwargs), self._part_deadline(size))

    async def _put_streaming(self, bucket: str, key: str, chunks: Iterable[memoryview | bytes]) -> None:
        import asyncio

        parts = _parts(chunks, self.part_bytes)
        first = next(parts, bytearray())
        second = next(parts, None)
        if second is None:
            await self._s3("put_object", size=len(first), Bucket=bucket, Key=key, Body=first)
            return
        upload_id = (await self._s3("create_multipart_upload", Bucket=bucket, Key=key))["UploadId"]
        slots = asyncio.Semaphore(self.concurrency)
        sent: list[asyncio.Task[dict[str, Any]]] = []

        async def send(number: int, body: bytearray) -> dict[str, Any]:
            try:
                out = await self._s3("upload_part", size=len(body), Bucket=bucket, Key=key,
                                     UploadId=upload_id, PartNumber=number, Body=body)
                return {"PartNumber": number, "ETag": out["ETag"]}
            finally:
                slots.release()

        try:
            for number, body in enumerate(_chain_parts(first, second, parts), start=1):
                await slots.acquire()  # bounds the parts held in memory
                if any(t.done() and t.exception() for t in sent):
                    slots.release()
                    break
                sent.append(asyncio.ensure_future(send(number, body)))
            done = await asyncio.gather(*sent)
            await self._s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                           MultipartUpload={"Parts": sorted(done, key=lambda p: p["PartNumber"])})
        except BaseException:
            for task in sent:
                task.cancel()
            await asyncio.gather(*sent, return_exceptions=True)
            try:
                await self._s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception as e:  # collected later by collect_abandoned_uploads
                log.warning("aborting the upload of s3://%s/%s failed: %s", bucket, key, e)
            raise

    def _lost_the_race(self, e: StorageError) -> bool:
        # s3fs names a failed If-None-Match only when the server names the condition
        return isinstance(e, CheckpointExistsError) or _is_precondition_failed(e)

    def list_dir(self, path: str) -> list[str]:
        """Names with at least one object under them, from an uncached recursive listing.

        A delimiter listing can report a prefix whose objects are all deleted (SeaweedFS keeps
        empty folders); deriving names from the objects themselves cannot.
        """
        target = _join(self.root, path)
        self.fs.invalidate_cache(target)
        keys = self._call("listing", target, "find", target)
        prefix = target.rstrip("/") + "/"
        return sorted({k[len(prefix):].split("/", 1)[0] for k in keys if k.startswith(prefix)} - {""})

    def list_files(self, path: str = "", start_after: str | None = None) -> dict[str, str]:
        """One paginated ListObjectsV2 (1,000 keys a page), from `start_after` on when given: the
        store skips what sorts before it, so a listing of only the newest steps costs one page
        (0.03 s here against 3.4 s for a root of 8,000 objects)."""
        from fsspec.asyn import sync

        target = _join(self.root, path)
        bucket, _, key = target.partition("/")
        prefix = key.rstrip("/") + "/" if key else ""
        self.fs.invalidate_cache(target)
        try:
            return sync(self.fs.loop, self._list_objects, bucket, prefix, start_after,
                        timeout=self.call_timeout * 10)
        except FileNotFoundError:  # no such bucket: nothing under it
            return {}
        except (TimeoutError, OSError, *_client_errors()) as e:  # type: ignore[misc]  # a tuple of classes
            raise StorageError(getattr(e, "errno", None) or errno.EIO,
                               f"listing {self.public(target)} failed: {type(e).__name__}: {e}") from e

    async def _list_objects(self, bucket: str, prefix: str, start_after: str | None) -> dict[str, str]:
        out: dict[str, str] = {}
        request: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        if start_after is not None:
            request["StartAfter"] = prefix + start_after
        while True:
            page = await self._s3("list_objects_v2", **request)
            for item in page.get("Contents", []):
                relative = item["Key"][len(prefix):]
                if relative and not relative.endswith("/"):
                    out[relative] = str(item.get("ETag", ""))
            if not page.get("IsTruncated"):
                return out
            request["ContinuationToken"] = page["NextContinuationToken"]
            request.pop("StartAfter", None)

    def newest_mtime(self, path: str) -> float | None:
        target = _join(self.root, path)
        self.fs.invalidate_cache(target)
        found = self._call("listing", target, "find", target, detail=True)
        times = [info["LastModified"].timestamp() for info in found.values() if info.get("LastModified")]
        return max(times, default=None)

    def collect_abandoned_uploads(self, grace_s: float, dry_run: bool = False) -> list[str]:
        bucket, _, prefix = self.root.partition("/")
        # The root's own keys only: "runs/a" as a bare prefix also matched "runs/ab/...", another
        # job's uploads, which a gc of runs/a then aborted.
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        found: list[str] = []
        request: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            try:
                page = self._call("listing uploads under", self.root, "call_s3", "list_multipart_uploads", **request)
            except StorageError as e:
                log.warning("listing multipart uploads under %s failed: %s", self.url, e)
                return found
            for upload in page.get("Uploads", []):
                initiated = upload.get("Initiated")
                age = time.time() - initiated.timestamp() if initiated is not None else grace_s
                if age < grace_s or not upload["Key"].startswith(prefix):
                    continue
                if not dry_run:
                    self._call("aborting the upload of", f"{bucket}/{upload['Key']}", "call_s3",
                               "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                found.append(upload["Key"][len(prefix):])
            if not page.get("IsTruncated") or not page.get("NextKeyMarker"):
                return found
            request.update(KeyMarker=page["NextKeyMarker"], UploadIdMarker=page.get("NextUploadIdMarker", ""))


def _number(options: dict[str, Any], name: str, default: Any, kind: type, low: float,
            high: float = float("inf")) -> Any:
    """Pop storage option `name` as a `kind` in [low, high]; ConfigError naming it otherwise
    (concurrency=0 waited forever on its semaphore, range_bytes=0 raised a bare ValueError)."""
    value = options.pop(name, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or float(value).is_integer())
    if not ok or not low <= value <= high:
        bound = f"at least {low:g}" + (f" and at most {high:g}" if high != float("inf") else "")
        raise ConfigError(f"storage option {name}={shown(value)}: must be {'an integer' if kind is int else 'a number'} "
                          f"{bound}")
    return kind(value)


def part_size(number: int, base: int) -> int:
    """Size of part `number` (from 1): `base` for the first 1000 parts, then doubling every
    1000, so small parts keep a 256 MiB upload fast and an object still reaches S3's 5 TiB
    (at most 10,000 parts of at most 5 GiB) without knowing its size in advance."""
    return min(base << ((number - 1) // PARTS_PER_SIZE), MAX_PART_BYTES)


def _parts(chunks: Iterable[memoryview | bytes], base: int) -> Iterator[bytearray]:
    """Regroup chunks into parts of part_size(n, base) bytes (the last one shorter), each a new
    buffer filled by one copy (the previous `+=` then `bytes()` copied every byte twice)."""
    number, filled = 1, 0
    buf = bytearray(part_size(number, base))
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            take = min(len(buf) - filled, len(view))
            buf[filled:filled + take] = view[:take]
            filled += take
            view = view[take:]
            if filled == len(buf):
                yield buf
                number, filled = number + 1, 0
                buf = bytearray(part_size(number, base))
    if filled:
        del buf[filled:]
        yield buf


def _chain_parts(first: bytearray, second: bytearray, rest: Iterator[bytearray]) -> Iterator[bytearray]:
    yield first
    yield second
    yield from rest


def _client_errors() -> tuple[type[BaseException], ...]:
    import aiohttp
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError, aiohttp.ClientError)


# The one translation table for a conditional create that lost: S3 error codes and HTTP statuses
# (s3fs maps PreconditionFailed to FileExistsError only when the server names the condition,
# which SeaweedFS does not; then the botocore response in the cause chain still says it).
CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
CONFLICT_STATUSES = frozenset({409, 412})


def _is_precondition_failed(e: BaseException) -> bool:
    seen: BaseException | None = e
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in CONFLICT_CODES or status in CONFLICT_STATUSES:
                return True
        seen = seen.__cause__ or seen.__context__
    return False


SPEC = register_backend(BackendSpec(
    name="s3", schemes=("s3", "s3a"), open=S3Storage.from_url, exclusive_create=True, container="bucket",
    client_packages=("s3fs", "aiobotocore", "botocore", "aiohttp"), install_hint="pip install 'distckpt[s3]'",
    # botocore's retry backoff, legacy and standard modes, drew from the global `random` stream
    jitter_modules=("botocore.retryhandler", "botocore.retries.standard"),
    secret_env=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"),
    secret_options=("key", "secret", "token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"),
    credential_env_prefixes=("AWS_", "BOTO_", "FSSPEC_"), selected_by=()))
