#!/bin/sh
# A base image for docker/Dockerfile on a machine that reaches no image registry (so no
# python:3.11-slim) but does reach a Debian mirror and PyPI:
#
#   docker/offline-base.sh [TAG]        # default TAG: distckpt-base:bookworm
#   docker-compose -f docker/compose.yaml build \
#       --build-arg BASE=distckpt-base:bookworm --build-arg TORCH_INDEX=https://pypi.org/simple
#
# debootstrap builds a minimal Debian bookworm (its python3 is 3.11, like python:3.11-slim), and
# three things of this host go in with it, because pip inside the build needs them:
#   - the host's CA bundle: where TLS to PyPI goes through an intercepting proxy, Debian's own
#     bundle does not trust it;
#   - the wheels of the host's pip find-links directory (DISTCKPT_WHEELS, default /opt/wheels):
#     PyTorch's CPU wheel index (download.pytorch.org) may be out of reach, and PyPI's torch is
#     the multi-GB CUDA build; a local torch-2.13.0+cpu wheel wins over it (a higher version);
#   - an /etc/pip.conf naming those two, so every pip in the image (the venv's included) uses them.
# Needs root (debootstrap, chroot) and the debootstrap package. Does nothing if TAG exists.
set -eu
TAG="${1:-distckpt-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
WHEELS="${DISTCKPT_WHEELS:-/opt/wheels}"
CA_BUNDLE="${DISTCKPT_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "offline-base: $TAG exists; remove it (docker rmi $TAG) to rebuild it"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "offline-base: debootstrap needs root; run as root (or: sudo $0)" >&2
    exit 1
fi
if ! command -v debootstrap >/dev/null; then
    echo "offline-base: debootstrap is missing: apt-get install debootstrap" >&2
    exit 1
fi

ROOTFS="$(mktemp -d /var/tmp/distckpt-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
echo "offline-base: debootstrap bookworm from $MIRROR into $ROOTFS (a few minutes)"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR" > "$ROOTFS.log" 2>&1 || {
    tail -20 "$ROOTFS.log" >&2
    echo "offline-base: debootstrap failed; full log in $ROOTFS.log" >&2
    exit 1
}
rm -f "$ROOTFS.log"
# The packages' .debs and the apt lists are not needed in the image.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*

if [ -f "$CA_BUNDLE" ]; then
    cp "$CA_BUNDLE" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
fi
mkdir -p "$ROOTFS/opt/wheels"
if [ -d "$WHEELS" ]; then
    # Only the wheels themselves; a find-links directory may also hold other files.
    find "$WHEELS" -maxdepth 1 -name '*.whl' -exec cp {} "$ROOTFS/opt/wheels/" \;
fi
echo "offline-base: wheels for find-links: $(ls "$ROOTFS/opt/wheels" | tr '\n' ' ')"
cat > "$ROOTFS/etc/pip.conf" <<'EOF'
# Written by docker/offline-base.sh: this host's CA bundle and its wheels (torch's CPU build).
[global]
cert = /etc/ssl/certs/ca-certificates.crt
find-links = /opt/wheels
EOF

# An imported tarball has no image config: give it the PATH and locale python:3.11-slim has
# (the Dockerfile's `ENV PATH=/opt/venv/bin:$PATH` would otherwise drop /usr/bin).
tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$TAG" >/dev/null
echo "offline-base: imported $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
