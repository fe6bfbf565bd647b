"""Reads the history of an offline W&B run (``run-*.wandb``), so tests can check what reached the logger.

The file is a sequence of protobuf ``Record`` messages in 32 KiB blocks, each chunk behind a 7-byte header
(crc32, length, kind: 1 whole, 2 first, 3 middle, 4 last), after a 7-byte file header starting ``:W&B``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7


def _chunks(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", f"not a W&B run file (starts {data[:8]!r})"
    pos, records, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # too little room for a header: the rest of the block is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        else:
            records.append(pending + chunk)
    return records


def history(save_dir: Path) -> list[dict]:
    """Every history row of the offline run under ``save_dir``: {key (nested keys joined by '/'): value}."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(save_dir).rglob("run-*.wandb")
    rows = []
    for raw in _chunks(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows
