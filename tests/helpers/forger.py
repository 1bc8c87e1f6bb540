"""What an attacker with write access to the bucket (and no key) does to a committed step: replace
tensor bytes, recompute every checksum the format holds (the file's xxh3 and BLAKE3 in the
manifest, the manifest's xxh3 in the marker, the marker's own sum), and put the step back
together. A signature it cannot make: it leaves the old one, removes it, or signs with its own key."""

from __future__ import annotations

import json
import os
import re
import struct

import xxhash

from distckpt.io import manifest as mf
from distckpt.io import signing


def payload_start(data: bytes) -> int:
    """Where a safetensors file's tensor bytes begin."""
    return 8 + struct.unpack("<Q", data[:8])[0]


def forge_step(root: str, step: int, name: str | None = None, offset: int = 0, new: bytes = b"\x00\x00\x80\x7f",
               signature: str = "keep", other_key: object = None) -> None:
    """Rewrite `new` into file `name` (default: the replicated file) of `step`, `offset` bytes into
    its tensor data, then re-make the manifest and marker consistently. `signature`: "keep"
    (the stale one), "remove", or "resign" with `other_key` (an Ed25519 private key)."""
    base = os.path.join(root, mf.step_dir(step))
    raw = json.loads(open(os.path.join(base, mf.MANIFEST), "rb").read())
    name = name or next(n for n in raw["files"] if n.startswith("replicated/"))
    path = os.path.join(base, name)
    data = bytearray(open(path, "rb").read())
    at = payload_start(bytes(data)) + offset
    data[at:at + len(new)] = new
    open(path, "wb").write(data)
    record = raw["files"][name]
    record["xxh3_64"] = xxhash.xxh3_64_hexdigest(bytes(data))
    if signing.DIGEST in record:
        record[signing.DIGEST] = signing.digest_of(bytes(data))
    remake(root, step, raw)
    sig = os.path.join(base, signing.SIGNATURE)
    if signature == "remove" and os.path.exists(sig):
        os.remove(sig)
    elif signature == "resign":
        manifest = open(os.path.join(base, mf.MANIFEST), "rb").read()
        open(sig, "wb").write(signing.signature_bytes(other_key, manifest))


def remake(root: str, step: int, raw: dict) -> None:
    """Write manifest fields `raw` and a marker that matches them, as the library would."""
    base = os.path.join(root, mf.step_dir(step))
    data = mf.manifest_bytes(raw)
    open(os.path.join(base, mf.MANIFEST), "wb").write(data)
    old = mf.Marker.parse(open(os.path.join(base, mf.MARKER), "rb").read(), base)
    marker = mf.Marker(step, mf.checksum_of(data), old.run_id, old.generation)
    open(os.path.join(base, mf.MARKER), "wb").write(marker.to_bytes())


def rewrite_trees(root: str, step: int, pattern: str, replacement: str, files: str = "") -> int:
    """`re.subn(pattern, replacement)` over the JSON tree in each payload file of `step` whose name
    starts with `files`, each changed file's digest and the manifest and marker re-made: how many
    places changed."""
    base = os.path.join(root, mf.step_dir(step))
    raw = json.loads(open(os.path.join(base, mf.MANIFEST), "rb").read())
    changed = 0
    for name in raw["files"]:
        if not name.startswith(files):
            continue
        blob = open(os.path.join(base, name), "rb").read()
        (n,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + n])
        tree, count = re.subn(pattern, replacement, header["__metadata__"]["distckpt.tree"])
        if not count:
            continue
        changed += count
        header["__metadata__"]["distckpt.tree"] = tree
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        new = struct.pack("<Q", len(text)) + text + blob[8 + n:]
        open(os.path.join(base, name), "wb").write(new)
        raw["files"][name] = {"size": len(new), "xxh3_64": xxhash.xxh3_64_hexdigest(new)}
    remake(root, step, raw)
    return changed
