"""Sizes as people write them: '5GB', '500MiB', '2.5 GB', or a count of bytes.

Hugging Face's convention for `max_shard_size`: KB, MB, GB, TB are powers of 1000, KiB, MiB,
GiB, TiB powers of 1024, case aside. Light (no torch), so the command line refuses a bad
--max-shard-size before it imports anything heavy.
"""

from __future__ import annotations

import re
from fractions import Fraction

from distckpt.errors import ConfigError, shown

# ASCII digits only (\d also took "٢"); a unit is B or a prefix and B ("iB" alone is no unit)
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_SCALE = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
LARGEST_SIZE = 2**63 - 1  # bytes: a file offset's bound; far above any shard


def parse_size(text: str | int, name: str = "max_shard_size") -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000; ConfigError naming `name` and the value
    for anything else, or a size that is not from 1 byte to LARGEST_SIZE."""
    usage = f"{name}={shown(text)}: a positive int of bytes, or a size such as 5GB, 500MB or 2GiB"
    if isinstance(text, bool) or not isinstance(text, (int, str)):  # 1.5 was taken as a byte count of 1
        raise ConfigError(usage)
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.fullmatch(text.strip())
        if not match:
            raise ConfigError(f"{name}={shown(text)}: a size such as 5GB, 500MB or 2GiB")
        # exact: a float overflowed to infinity on a 400-digit number
        size = int(Fraction(match.group(1)) * _SCALE[(match.group(2) or "B").upper()])
    if size <= 0:
        raise ConfigError(f"{name}={shown(text)}: must be positive (at least 1 byte)")
    if size > LARGEST_SIZE:
        raise ConfigError(f"{name}={shown(text)}: at most {LARGEST_SIZE} bytes (2**63-1)")
    return size
