"""Tamper-evident checkpoints: a BLAKE3 digest of every payload file and an Ed25519 signature
over the manifest that lists them.

xxh3 (checksums.py) detects accidents, not forgery: anyone who can write to the bucket can
replace a tensor and recompute its checksum, the manifest's and the marker's. With a signing
key, every file record also carries ``"blake3"`` (computed in the same pass as xxh3, on the
hashing helper thread, while the file is written), and rank 0 writes ``SIGNATURE`` into the
step directory before the commit marker::

    {"format": 1, "algorithm": "ed25519", "key": "ed25519:<fingerprint>",
     "manifest_blake3": "<hex>", "signature": "<base64>"}

The signature covers ``_DOMAIN + blake3(manifest bytes)``; the manifest names the step, the
run, the generation and every file (shared files of older steps included) with its digest, so
a verified manifest vouches for every byte a load reads. A reader with a verify key
(`Trust.verifier`) refuses a step whose signature is missing, unreadable, by another key or
invalid, whose manifest lists a file without a digest, or whose file does not match its digest:
`UntrustedCheckpointError`, a CorruptCheckpointError, so a load falls back to an older step
that verifies exactly as it does past damage.

Only Ed25519 (asymmetric): a reader holds the public key alone, which cannot sign. An HMAC key
would let every reader that verifies also forge, so it is not offered.

Keys are never logged, written, or put in a message or repr: only their fingerprint (the
first 16 bytes of SHA-256 of the raw public key, in hex). `cryptography` and `blake3` are the
optional extra ``distckpt[sign]``, imported only when a key is given.

This module never imports torch or torch.distributed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import stat
import weakref
from dataclasses import dataclass
from typing import Any

from distckpt.errors import ConfigError, MissingFileError, StorageError, UntrustedCheckpointError

_log = logging.getLogger("distckpt")

SIGNATURE = "SIGNATURE"
DIGEST = "blake3"  # the key of a file record's cryptographic digest
FORMAT = 1
MAX_SIGNATURE_BYTES = 64 << 20  # a signed table of every file of a step (`distckpt sign`)
SIGNING_ENV = "DISTCKPT_SIGNING_KEY"
VERIFY_ENV = "DISTCKPT_VERIFY_KEY"
_DOMAIN = b"distckpt signed manifest v1\n"
_INSTALL = "install the extra: pip install 'distckpt[sign]'"


# -- digests ----------------------------------------------------------------------------------

def new_digest(threads: int = 1) -> Any:
    """A BLAKE3 hasher (3x SHA-256's speed here: 0.057 s against 0.148 s over 256 MiB on one
    core). `threads` > 1 (a verified load's large files: checksums.digest_threads) hashes each
    update on that many threads of a pool the hasher starts for itself and stops with itself.
    Never blake3.AUTO: that runs on rayon's process-wide pool, which a forked child (a loader
    worker) inherits without its threads, and a hash there waits forever (tests/unit/
    test_digest_threads.py forks after each kind of use). A hasher of its own is safe across a
    fork as long as no child uses the parent's hasher, which none does: each is made, used and
    dropped within one call. Saves keep one thread: their hash runs beside the write."""
    try:
        import blake3
    except ImportError as e:  # pragma: no cover - the extra is installed with the key's package
        raise ConfigError(f"signed checkpoints need the blake3 package: {_INSTALL}") from e
    if threads > 1:
        try:
            return blake3.blake3(max_threads=threads)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001  (a thread the OS refused: a Rust panic, a BaseException)
            _log.warning("BLAKE3 could not start %d hashing threads (%s: %s); hashing on one", threads,
                         type(e).__name__, e)
    return blake3.blake3()


def digest_of(data: bytes | bytearray | memoryview) -> str:
    h = new_digest()
    h.update(data)
    return str(h.hexdigest())


# -- keys -------------------------------------------------------------------------------------

def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:
        raise ConfigError(f"signing_key / verify_key need the cryptography package: {_INSTALL}") from e
    return serialization, ed25519


def _pem_of(name: str, value: Any, env: str) -> bytes | None:
    """The PEM bytes a key argument stands for: PEM bytes or text, or a path to a PEM file; the
    environment variable `env` (PEM text or a path) when the argument is None. Never says the
    value itself."""
    if value is None:
        value = os.environ.get(env) or None
        if value is None:
            return None
        name = f"{name} (from ${env})"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    if isinstance(value, (str, os.PathLike)):
        return _key_file_bytes(name, value)
    raise ConfigError(f"{name}: must be PEM bytes, PEM text, a path to a PEM file, or None; got a "
                      f"{type(value).__name__}")


def _key_file_bytes(name: str, path: Any) -> bytes:
    """A key file's first 64 KiB. Opened without waiting (O_NONBLOCK) and read only if it is a
    regular file: a FIFO given as the key path held every command and the manager in open() for
    ever. A symbolic link to a key file is followed (mounted secrets are links)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{name}: a str or path names a PEM key file (or is PEM text starting "
                          f"'-----BEGIN'); the file cannot be read ({type(e).__name__})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{name}: the key path names no regular file (a FIFO, device, socket or directory "
                              "stands there); give the path of a PEM key file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(65536)
    except OSError as e:
        raise ConfigError(f"{name}: the key file cannot be read ({type(e).__name__})") from None
    finally:
        os.close(fd)


@dataclass(frozen=True, repr=False)
class Trust:
    """What one process signs with and verifies against; its repr names fingerprints only."""

    signer: Any = None    # Ed25519PrivateKey
    verifier: Any = None  # Ed25519PublicKey

    @classmethod
    def from_arguments(cls, signing_key: Any, verify_key: Any) -> "Trust | None":
        """The keys of CheckpointManager(signing_key=, verify_key=) (or their environment
        variables), parsed now: ConfigError naming the argument and what was expected."""
        signer = load_signing_key(signing_key)
        verifier = load_verify_key(verify_key)
        return None if signer is None and verifier is None else cls(signer, verifier)

    @property
    def digests(self) -> bool:
        """Whether this process writes digests into the file records it makes."""
        return self.signer is not None

    def shared_settings(self) -> dict[str, str | None]:
        """What every rank must hold alike, by fingerprint."""
        return {"signing_key": fingerprint(self.signer.public_key()) if self.signer is not None else None,
                "verify_key": fingerprint(self.verifier) if self.verifier is not None else None}

    def __repr__(self) -> str:
        shown = self.shared_settings()
        return f"Trust(signing_key={shown['signing_key']}, verify_key={shown['verify_key']})"

    def __deepcopy__(self, memo: Any) -> "Trust":
        return self  # immutable; its keys are not copyable objects


def load_signing_key(value: Any, name: str = "signing_key") -> Any:
    """An Ed25519 private key from PEM (bytes, text or a path; DISTCKPT_SIGNING_KEY), or None."""
    pem = _pem_of(name, value, SIGNING_ENV)
    if pem is None:
        return None
    if value is None:
        name = f"{name} (from ${SIGNING_ENV})"
    serialization, ed25519 = _crypto()
    if b"PUBLIC KEY" in pem and b"PRIVATE KEY" not in pem:
        raise ConfigError(f"{name}: a public key was given; signing needs the Ed25519 private key (-----BEGIN "
                          "PRIVATE KEY-----); the public key is the verify_key")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except TypeError:
        raise ConfigError(f"{name}: the private key is encrypted; give it unencrypted (PEM, PKCS#8), kept "
                          "readable by the job only") from None
    except ValueError:
        raise ConfigError(f"{name}: expected an Ed25519 private key in PEM (-----BEGIN PRIVATE KEY-----, "
                          f"e.g. `openssl genpkey -algorithm ed25519`); {what_pem_holds(pem)}") from None
    except Exception as e:  # cryptography's UnsupportedAlgorithm and the like
        raise ConfigError(f"{name}: expected an Ed25519 private key in PEM; it holds an unsupported key "
                          f"({type(e).__name__})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ConfigError(f"{name}: expected an Ed25519 private key; it holds a {_algorithm(key)} key")
    return key


def load_verify_key(value: Any, name: str = "verify_key") -> Any:
    """An Ed25519 public key from PEM (bytes, text or a path; DISTCKPT_VERIFY_KEY), or None. A
    private key is refused: readers need the public key only, and handing them the private one
    would let every reader sign."""
    pem = _pem_of(name, value, VERIFY_ENV)
    if pem is None:
        return None
    if value is None:
        name = f"{name} (from ${VERIFY_ENV})"
    serialization, ed25519 = _crypto()
    if b"PRIVATE KEY" in pem:
        raise ConfigError(f"{name}: a private key was given; pass the public key (-----BEGIN PUBLIC KEY-----, "
                          "`openssl pkey -in KEY -pubout`): readers never need the key that signs")
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError):
        raise ConfigError(f"{name}: expected an Ed25519 public key in PEM (-----BEGIN PUBLIC KEY-----); "
                          f"{what_pem_holds(pem)}") from None
    except Exception as e:
        raise ConfigError(f"{name}: expected an Ed25519 public key in PEM; it holds an unsupported key "
                          f"({type(e).__name__})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ConfigError(f"{name}: expected an Ed25519 public key; it holds a {_algorithm(key)} key")
    return key


def what_pem_holds(pem: bytes) -> str:
    """A description of what was given instead, from its PEM label only (never its content)."""
    if b"-----BEGIN" not in pem:
        return f"the {len(pem)} bytes given are not PEM"
    label = pem.split(b"-----BEGIN", 1)[1].split(b"-----", 1)[0].strip()[:40]
    return f"it holds a PEM block labelled {label.decode('ascii', 'replace')!r} that does not parse as one"


def _algorithm(key: Any) -> str:
    return type(key).__name__.removesuffix("PrivateKey").removesuffix("PublicKey").lstrip("_") or "another"


def fingerprint(public_key: Any) -> str:
    serialization, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:32]


# -- which storage signs and verifies ---------------------------------------------------------

# A manager (or a tool) opens its storages and attaches its Trust to them: every read and write
# through that storage object then signs and verifies, whichever protocol room runs it (a load,
# an incremental reference, an upload between tiers, an export), with nothing threaded through
# their signatures, and a storage with no Trust works as before.
_ATTACHED: "weakref.WeakKeyDictionary[Any, Trust]" = weakref.WeakKeyDictionary()


def attach(storage: Any, trust: Trust | None) -> None:
    if storage is None:
        return
    if trust is None:
        _ATTACHED.pop(storage, None)
    else:
        _ATTACHED[storage] = trust


def trust_of(storage: Any) -> Trust | None:
    try:
        return _ATTACHED.get(storage)
    except TypeError:  # an unhashable storage object: nothing can be attached to it
        return None


def writes_digests(storage: Any) -> bool:
    trust = trust_of(storage)
    return trust is not None and trust.digests


def refusal_hint(storage: Any) -> str:
    """What a load that found no step verifying adds when it verified signatures."""
    trust = trust_of(storage)
    if trust is None or trust.verifier is None:
        return ""
    return (f". Only steps signed by the verify key {fingerprint(trust.verifier)} verify: an unsigned step or one "
            "signed by another key is refused (`distckpt verify URL --key PUBKEY` says why for each)")


def verifies(storage: Any) -> bool:
    trust = trust_of(storage)
    return trust is not None and trust.verifier is not None


# -- the signature file -----------------------------------------------------------------------

def signature_bytes(signer: Any, manifest: bytes, files: dict[str, str] | None = None) -> bytes:
    """The SIGNATURE file's bytes for `manifest`. A save's manifest gives every file its digest;
    `files` (path -> BLAKE3) carries them instead for a step committed unsigned and signed
    afterwards (`distckpt sign`), whose manifest and marker are never rewritten."""
    body: dict[str, Any] = {"format": FORMAT, "algorithm": "ed25519", "key": fingerprint(signer.public_key()),
                            "manifest_blake3": digest_of(manifest)}
    if files is not None:
        body["files"] = dict(sorted(files.items()))
    body["signature"] = base64.b64encode(signer.sign(_signed_message(body))).decode()
    return json.dumps(body, sort_keys=True).encode()


def _signed_message(body: dict[str, Any]) -> bytes:
    fields = {k: v for k, v in body.items() if k != "signature"}
    return _DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign_step(storage: Any, base: str, manifest: bytes) -> None:
    """Rank 0, before the commit marker: write `base`/SIGNATURE when this storage signs (a
    committed signed step therefore always has its signature)."""
    trust = trust_of(storage)
    if trust is None or trust.signer is None:
        return
    storage.write_file(f"{base}/{SIGNATURE}", [signature_bytes(trust.signer, manifest)])


def check_step(storage: Any, base: str, manifest: bytes, parsed: Any) -> None:
    """When this storage verifies: the step's SIGNATURE is there, by the verify key, valid over
    these manifest bytes, and every file of the manifest (`parsed`) has a signed digest, which
    its record then carries for the reads. UntrustedCheckpointError naming what is wrong."""
    trust = trust_of(storage)
    if trust is None or trust.verifier is None:
        return
    where = f"{storage.url}/{base}"
    try:
        data = storage.read_bytes(f"{base}/{SIGNATURE}", MAX_SIGNATURE_BYTES)
    except MissingFileError:
        raise UntrustedCheckpointError(f"{where}: no {SIGNATURE} file: the step is not signed (a verify key "
                                       "refuses unsigned steps; `distckpt sign` signs a committed one)") from None
    except StorageError as e:
        raise UntrustedCheckpointError(f"{where}/{SIGNATURE}: unreadable ({e.strerror or e})") from e
    signed = verify_signature(trust.verifier, data, manifest, where)
    require_digests(parsed, signed, where)


def verify_signature(public_key: Any, signature: bytes, manifest: bytes, where: str) -> dict[str, str] | None:
    """UntrustedCheckpointError unless `signature` (a SIGNATURE file's bytes) is `public_key`'s
    valid signature of `manifest`; returns the signed digest table it carries (or None)."""
    from cryptography.exceptions import InvalidSignature

    body = _parse_signature(signature, where)
    expected = fingerprint(public_key)
    if body["key"] != expected:
        raise UntrustedCheckpointError(f"{where}: signed by key {str(body['key'])[:48]}, not by the verify key "
                                       f"{expected}")
    try:
        public_key.verify(base64.b64decode(body["signature"], validate=True), _signed_message(body))
    except (InvalidSignature, ValueError) as e:
        raise UntrustedCheckpointError(f"{where}: the signature is invalid (forged, or damaged)") from e
    if body["manifest_blake3"] != digest_of(manifest):
        raise UntrustedCheckpointError(f"{where}: the signature is of another manifest (the manifest was "
                                       "replaced or edited after signing)")
    return body.get("files")


def _parse_signature(data: bytes, where: str) -> dict[str, Any]:
    try:
        body = json.loads(data)
        ok = (isinstance(body, dict) and body.get("format") == FORMAT and body.get("algorithm") == "ed25519"
              and all(isinstance(body.get(k), str) for k in ("key", "manifest_blake3", "signature"))
              and (body.get("files") is None or (isinstance(body["files"], dict)
                                                 and all(isinstance(v, str) for v in body["files"].values()))))
    except (ValueError, RecursionError):
        ok = False
    if not ok:
        raise UntrustedCheckpointError(f"{where}/{SIGNATURE}: not a signature file this version reads")
    return body  # type: ignore[no-any-return]


def require_digests(parsed: Any, signed: dict[str, str] | None, where: str) -> None:
    """Every file of a signed manifest (its own and the older steps' it shares) has a digest, in
    its record or in the signature's table (which then goes into the record, over anything the
    record said): without one, the signature would vouch for a file only by its xxh3, which a
    forger recomputes."""
    for field, prefix in (("files", where.rsplit("/", 1)[-1] + "/"), ("shared_files", "")):
        for name, record in (getattr(parsed, field, None) or {}).items():
            if signed is not None:
                if prefix + name not in signed:
                    raise UntrustedCheckpointError(f"{where}: the signature gives {name[:80]!r} no digest")
                record[DIGEST] = signed[prefix + name]
            digest = record.get(DIGEST) if isinstance(record, dict) else None
            if not (isinstance(digest, str) and len(digest) == 64):
                raise UntrustedCheckpointError(f"{where}: the signed manifest gives {name[:80]!r} no {DIGEST} digest")


def check_digest(h: Any, record: dict[str, Any], where: str) -> None:
    """The digest `h` computed over a file against its record's."""
    expected = record.get(DIGEST)
    if not isinstance(expected, str):
        raise UntrustedCheckpointError(f"{where}: the manifest gives it no {DIGEST} digest")
    actual = h.hexdigest()
    if actual != expected:
        raise UntrustedCheckpointError(f"{where}: {DIGEST} digest {actual[:16]}... does not match the signed "
                                       f"manifest's {expected[:16]}... (replaced or damaged)")


def copy_signature(source: Any, target: Any, base: str) -> None:
    """An upload between tiers carries the step's signature (before its marker), if it has one."""
    try:
        data = source.read_bytes(f"{base}/{SIGNATURE}", MAX_SIGNATURE_BYTES)
    except MissingFileError:
        return
    target.write_file(f"{base}/{SIGNATURE}", [data])

