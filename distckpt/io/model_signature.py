"""A signature of a whole directory in the format of OpenSSF model-signing (the `model-signing`
package, v1.0 of its predicate), verifiable with its own tools::

    model_signing verify key MODEL_DIR --signature MODEL_DIR.sig --public_key key.pub

The format, as model-signing 1.1.1 writes and reads it for its "private key" method:

* every regular file under the directory, except the ignored paths, hashed with SHA-256, named
  by its POSIX path relative to the directory (its `files` serialization: one digest per file);
* an in-toto Statement v1 whose one subject is the directory's name with the SHA-256 of all those
  digests concatenated in resource order, of predicate type ``https://model_signing/signature/v1.0``
  with the predicate ``{"serialization": {...}, "resources": [{name, algorithm, digest}]}``;
* the statement as the payload of a DSSE envelope (type ``application/vnd.in-toto+json``), its
  signature an ECDSA signature (DER) over the DSSE pre-authentication encoding, hashed with
  SHA-256, SHA-384 or SHA-512 for a P-256, P-384 or P-521 key;
* that envelope in a Sigstore bundle v0.3 JSON whose verification material is a public key hint
  only: the SHA-256 of the public key's PEM (SubjectPublicKeyInfo), in hex. No transparency log.

It is written here with `cryptography` and hashlib, not through the `model-signing` package: the
format is this small, while the package pulls in sigstore, tuf, pydantic, protobuf and pyOpenSSL
(model-signing 1.1.1 imports pyOpenSSL without declaring it), none of which signing needs. The
tests verify what is written here with model-signing's own verifier.

Only elliptic-curve keys on P-256, P-384 or P-521: model-signing's key verifier accepts no
other (an Ed25519 key, the kind distckpt signs checkpoints with, is refused by it). Keys are
never logged or shown; the public key hint is.

This module never imports torch or torch.distributed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from distckpt.errors import ConfigError, shown
from distckpt.io.signing import _pem_of, what_pem_holds

SUFFIX = ".sig"  # model-signing's own default is `model.sig`, beside the model directory
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
# What model-signing ignores by default (hashing.Config, ignore_git_paths=True), relative to the
# model directory; recorded in the signature, as model-signing records them.
GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")
CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
MAKE_KEY = ("make one with `openssl ecparam -name prime256v1 -genkey -noout -out model-signing.pem` and its "
            "public key with `openssl ec -in model-signing.pem -pubout -out model-signing.pub`")
_CHUNK = 4 << 20


@dataclass(frozen=True)
class SignaturePlan:
    """Where a directory's signature goes, checked before anything is written."""

    model_dir: str
    path: str  # as given (relative to the working directory, if it was)
    inside: str | None  # the signature's POSIX path relative to model_dir when it lies in it (ignored)

    @property
    def ignored(self) -> list[str]:
        return list(GIT_PATHS) + ([self.inside] if self.inside is not None else [])


@dataclass(frozen=True)
class SignedDirectory:
    path: str
    files: int
    key_hint: str


# -- the key ----------------------------------------------------------------------------------

def load_key(value: Any, name: str = "sign_key") -> Any:
    """An elliptic-curve private key on P-256, P-384 or P-521 from PEM (bytes, text or a path to
    a PEM file): ConfigError naming `name`, the accepted key types and how to make one for
    anything else (never the key's content)."""
    if value is None:
        raise ConfigError(f"{name}: a private key is needed to sign; {MAKE_KEY}")
    pem = _pem_of(name, value, "") or b""  # value is not None: no environment variable is read
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError as e:
        raise ConfigError(f"{name}: signing needs the cryptography package: pip install 'distckpt[sign]'") from e
    accepted = "an elliptic-curve private key on P-256, P-384 or P-521 in PEM (the key types OpenSSF model-signing accepts)"
    if b"PUBLIC KEY" in pem and b"PRIVATE KEY" not in pem:
        raise ConfigError(f"{name}: a public key was given; signing needs {accepted}")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except TypeError:
        raise ConfigError(f"{name}: the private key is encrypted; give it unencrypted (`openssl ec -in KEY -out "
                          "PLAIN`), kept readable by you only") from None
    except ValueError:
        raise ConfigError(f"{name}: expected {accepted}; {what_pem_holds(pem)}; {MAKE_KEY}") from None
    except Exception as e:  # cryptography's UnsupportedAlgorithm and the like
        raise ConfigError(f"{name}: expected {accepted}; it holds an unsupported key ({type(e).__name__}); "
                          f"{MAKE_KEY}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        kind = type(key).__name__.removesuffix("PrivateKey").lstrip("_") or "another"
        raise ConfigError(f"{name}: expected {accepted}; it holds an {kind} key, which model-signing's verifier "
                          f"refuses (distckpt's own checkpoint signing key is Ed25519 and is not accepted here); "
                          f"{MAKE_KEY}")
    if key.curve.name not in CURVES:
        raise ConfigError(f"{name}: expected {accepted}; it holds an elliptic-curve key on {key.curve.name}, "
                          f"which model-signing refuses; {MAKE_KEY}")
    return key


def key_hint(public_key: Any) -> str:
    """model-signing's public key identifier: SHA-256 of the SubjectPublicKeyInfo PEM, in hex."""
    from cryptography.hazmat.primitives import serialization

    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


# -- where it goes ----------------------------------------------------------------------------

def default_path(model_dir: str) -> str:
    """`OUT.sig` beside `OUT`: outside the directory (model-signing's convention), named after
    it so that two exports side by side keep a signature each."""
    return os.path.normpath(model_dir) + SUFFIX


def plan_signature(model_dir: str, path: Any, reserved: Any = None, name: str = "signature") -> SignaturePlan:
    """The signature's place, checked before anything is written: a local file path (default
    `default_path`), not a directory, its folder existing (or the model directory itself). One
    inside `model_dir` is recorded as ignored, as model-signing's own signer records it, so its
    verifier skips it; it may not take a name `reserved` (a callable: True for a name the export
    writes). The model directory itself may not be a link: model-signing refuses one."""
    if path is None:
        path = default_path(model_dir)
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise ConfigError(f"{name}={shown(path)}: must be the path of the signature file to write")
    if os.path.islink(model_dir):
        raise ConfigError(f"out_dir={shown(model_dir)} is a symbolic link, which model-signing's verifier refuses; "
                          "export into the directory it points to")
    model_abs, path_abs = os.path.abspath(model_dir), os.path.abspath(path)
    if path_abs == model_abs:
        raise ConfigError(f"{name}={shown(path)} is the export directory itself: name a file, e.g. "
                          f"{default_path(model_dir)!r}")
    if os.path.isdir(path_abs):
        raise ConfigError(f"{name}={shown(path)} is a directory: name the signature file, e.g. "
                          f"{os.path.join(path, 'model' + SUFFIX)!r}")
    folder = os.path.dirname(path_abs)
    if folder != model_abs and not os.path.isdir(folder):
        raise ConfigError(f"{name}={shown(path)}: its folder {folder!r} does not exist")
    inside = _relative_inside(path_abs, model_abs)
    if inside is not None and reserved is not None and reserved(inside):
        raise ConfigError(f"{name}={shown(path)}: that name inside {model_dir!r} is one the export writes; put the "
                          f"signature beside the directory (default {default_path(model_dir)!r}) or name it model.sig")
    return SignaturePlan(model_dir, path, inside)


def _relative_inside(path_abs: str, model_abs: str) -> str | None:
    rel = os.path.relpath(path_abs, model_abs)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return None
    return rel.replace(os.sep, "/")


# -- the digests ------------------------------------------------------------------------------

def directory_files(plan: SignaturePlan) -> list[str]:
    """Every regular file under the model directory that model-signing hashes, as POSIX paths
    relative to it, in model-signing's order (by path components). A symbolic link or a special
    file anywhere (ignored paths too: model-signing checks before it ignores) is a ConfigError,
    since model-signing's verifier would refuse the directory."""
    found: list[str] = []
    for folder, dirs, files in os.walk(plan.model_dir, onerror=_raise):
        for entry in dirs + files:
            full = os.path.join(folder, entry)
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                what = "a symbolic link" if stat.S_ISLNK(mode) else "neither a file nor a directory"
                raise ConfigError(f"{full} is {what}, which model-signing's verifier refuses in a model directory: "
                                  "remove it (or copy what it points to in) before signing")
            rel = os.path.relpath(full, plan.model_dir).replace(os.sep, "/")
            if stat.S_ISREG(mode) and not _ignored(rel, plan.ignored):
                found.append(rel)
    return sorted(found, key=lambda rel: rel.split("/"))


def _raise(error: OSError) -> None:
    raise error  # a folder that cannot be listed: a signature leaving its files out would not verify


def _ignored(rel: str, ignored: list[str]) -> bool:
    return any(rel == p or rel.startswith(p + "/") for p in ignored)


def sha256_of_file(path: str) -> str:
    h = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


# -- the statement, the envelope, the bundle --------------------------------------------------

def statement(model_name: str, resources: list[tuple[str, str]], ignored: list[str]) -> bytes:
    """The in-toto statement over (path, SHA-256) pairs, in the order given."""
    root = hashlib.sha256()
    for _, digest in resources:
        root.update(bytes.fromhex(digest))
    body = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": model_name, "digest": {"sha256": root.hexdigest()}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
                              "ignore_paths": ignored},
            "resources": [{"name": name, "algorithm": "sha256", "digest": digest} for name, digest in resources],
        },
    }
    return json.dumps(body, indent=2).encode()


def pae(payload: bytes) -> bytes:
    """DSSE v1's pre-authentication encoding, what the signature covers."""
    return b"DSSEv1 %d %s %d %s" % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload), payload)


def bundle(key: Any, payload: bytes) -> bytes:
    """The Sigstore bundle JSON of `payload` signed by the elliptic-curve `key`."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    digest = {256: hashes.SHA256(), 384: hashes.SHA384(), 521: hashes.SHA512()}[key.curve.key_size]
    signature = key.sign(pae(payload), ec.ECDSA(digest))
    body = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key_hint(key.public_key())}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode(),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": ""}],
        },
    }
    return json.dumps(body, separators=(",", ":")).encode()


def model_name_of(model_dir: str) -> str:
    """model-signing's subject name: the directory's last component (informative only)."""
    name = os.path.basename(os.path.normpath(model_dir))
    if not name or name in (os.curdir, os.pardir):
        name = os.path.basename(os.path.realpath(model_dir))
    return name


def sign_directory(key: Any, plan: SignaturePlan) -> SignedDirectory:
    """Hash every file of the directory, sign, and write the signature whole (a temporary file
    synced, then renamed over the old one: a reader never sees half a signature)."""
    names = directory_files(plan)
    resources = [(name, sha256_of_file(os.path.join(plan.model_dir, *name.split("/")))) for name in names]
    payload = statement(model_name_of(plan.model_dir), resources, plan.ignored)
    data = bundle(key, payload)
    tmp = plan.path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, plan.path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    return SignedDirectory(plan.path, len(resources), key_hint(key.public_key()))
