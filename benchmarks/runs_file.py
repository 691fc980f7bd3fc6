"""Reading a recorded runs file: ``*_runs.json`` as a benchmark writes it, or the same file
compressed (``gzip -9``: ``*_runs.json.gz``, as docs/benchmarks/ keeps them). Every script that
takes a runs file as a path (``--report-only``, ``memory_moments``, ``reprice_memory``) reads it here.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

GZIP_MAGIC = b"\x1f\x8b"


def read_runs(path: str | Path) -> Any:
    """The JSON a runs file holds, gzip-compressed or not (told by its first bytes, not its name)."""
    data = Path(path).read_bytes()
    if data[:2] == GZIP_MAGIC:
        data = gzip.decompress(data)
    return json.loads(data)
