"""Reading a W&B offline run file (``run-<id>.wandb``) back, for tests of the ``wandb``
tracker. wandb no longer ships a Python reader; the file is a LevelDB-style log (a 7-byte
file header ``:W&B``, magic 0xBEE1, version 0; then 32 KiB blocks of records, each with a
7-byte header: CRC32, length, type FULL/FIRST/MIDDLE/LAST) of protobuf ``Record``s, which
wandb's own ``wandb_internal_pb2`` decodes."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # block trailer: padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """The logged rows: ``_step`` and every key, values decoded from JSON."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            rows.append(row)
    return rows


def exit_code(path: Path) -> int | None:
    for record in records(path):
        if record.WhichOneof("record_type") == "exit":
            return record.exit.exit_code
    return None
