"""The command line's signing: `distckpt sign` (an existing committed step) and the verify key of
`verify`, `ls --verify` and `export` (io/signing.py holds the format).

A step committed without a key is signed afterwards without touching its manifest or marker
(rewriting either would uncommit the step for a moment, and a crash then would lose it): every
file is read once, checked against its xxh3 record, and its BLAKE3 digest goes into the
SIGNATURE file's own signed table.
"""

from __future__ import annotations

from typing import Any

from distckpt.errors import CorruptCheckpointError, DistCkptError, MissingFileError
from distckpt.io import manifest as mf
from distckpt.io import signing
from distckpt.io.reading import read_verified
from distckpt.protocol.commit import read_marker, read_verified_manifest
from distckpt.storage import Storage


def use_verify_key(storages: list[Storage], key: Any) -> None:
    """Every read through `storages` verifies against `key` (a path or PEM; None: the
    DISTCKPT_VERIFY_KEY environment variable, else nothing)."""
    verifier = signing.load_verify_key(key, "--key")
    if verifier is not None:
        for storage in storages:
            signing.attach(storage, signing.Trust(verifier=verifier))


def sign_step(storage: Storage, step: int, key: Any) -> dict[str, Any]:
    """Sign committed `step` with the private key `key` (a path or PEM): CorruptCheckpointError,
    and nothing written, when the step is not committed or a file does not match its checksum."""
    signer = signing.load_signing_key(key, "--key")
    if signer is None:
        raise CorruptCheckpointError("--key: a private key is needed to sign")
    base = mf.step_dir(step)
    where = f"{storage.url}/{base}"
    try:
        marker = read_marker(storage, step)
    except MissingFileError:
        raise CorruptCheckpointError(f"{where}: not committed (no {mf.MARKER} marker): only a committed step is "
                                     "signed") from None
    manifest = read_verified_manifest(storage, step, marker)
    manifest_bytes = storage.read_bytes(f"{base}/{mf.MANIFEST}", mf._MAX_MANIFEST_BYTES)
    if mf.checksum_of(manifest_bytes) != marker.manifest_digest:  # replaced since it was verified
        raise CorruptCheckpointError(f"{where}: the manifest changed while it was read; nothing signed")
    table: dict[str, str] = {}
    wanted = [(f"{base}/{name}", record) for name, record in manifest.files.items()]
    wanted += list((manifest.shared_files or {}).items())  # incremental: older steps' files it reads
    for path, record in wanted:
        try:
            data = read_verified(storage, path, record, f"{storage.url}/{path}")
        except MissingFileError:
            raise CorruptCheckpointError(f"{storage.url}/{path} is missing: the step is damaged; nothing "
                                         "signed") from None
        except DistCkptError as e:
            raise CorruptCheckpointError(f"{e}; the step is damaged: nothing signed") from e
        table[path] = signing.digest_of(data)
    storage.write_file(f"{base}/{signing.SIGNATURE}", [signing.signature_bytes(signer, manifest_bytes, table)])
    return {"step": step, "files": len(table), "key": signing.fingerprint(signer.public_key())}
