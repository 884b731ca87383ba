"""The one JSON reader and writer of store objects: bounded, strict, never recursing too deep.

Everything read from a bucket is untrusted (docs/STORE.md, "Threat model"). `load_json` turns any bytes
into a dict or a `BadJSON` (a `CorruptObject`) with a one-line reason: nothing else escapes, not
even a RecursionError, because the nesting depth is measured (linear time, bounded memory)
before the parser runs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from training.store.objectstore import CorruptObject


class BadJSON(CorruptObject):
    """Bytes that are not one bounded, strict JSON object."""


def one_line(text: Any, limit: int = 300) -> str:
    """`text` on one line (control characters escaped), at most `limit` characters."""
    flat = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def show(value: Any, limit: int = 60) -> str:
    """A short repr of an untrusted value for an error message (never a megabyte)."""
    if isinstance(value, dict | list) and len(value) > 8:
        return f"<{type(value).__name__} of {len(value)}>"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"<int of {len(str(abs(value)))} digits>"
    return one_line(repr(value), limit)


@dataclass(frozen=True)
class JSONLimits:
    """Caps of one JSON read: size in bytes, nesting depth, digits of one integer."""

    max_bytes: int
    max_depth: int = 16
    max_int_digits: int = 30


POINTER = JSONLimits(4 * 2**10, 4)  # HEAD, LATEST, ledger entries, done markers
MANIFEST = JSONLimits(64 * 2**10, 8)  # a pseudo-gradient marker
QUARANTINE = JSONLimits(16 * 2**10, 4)
HEARTBEAT = JSONLimits(64 * 2**10, 8)
METRIC = JSONLimits(256 * 2**10, 8)
CONFIG = JSONLimits(2**20, 16)
CHECKPOINT_META = JSONLimits(4 * 2**20, 16)
FRAGMENT_MANIFEST = JSONLimits(16 * 2**20, 16)  # merger-written; one merge's `applied` list
SNAPSHOT = JSONLimits(256 * 2**10, 8)  # a snapshot record, BEST
LEASE = JSONLimits(4 * 2**10, 1)  # a syncer shard's lease: one flat object
RUN_MARKER = JSONLimits(256 * 2**10, 2)  # a DAG run's islands-ended marker: names its islands
FINALIZED = JSONLimits(4 * 2**10, 1)  # the claim of the one finalize: a run id and a time

# A string literal. Once a '"' starts one it always matches (to its closing quote or the end),
# possessively, so stripping the strings is linear even on hostile input.
_STRING = re.compile(rb'"(?:[^"\\]|\\.?)*+(?:"|\Z)', re.DOTALL)
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_CHUNK = 2**20


def nesting_depth(data: bytes, stop_above: int | None = None) -> int:
    """Bracket nesting depth of JSON text `data`, string contents skipped; linear time, memory
    bounded by a 1 MiB chunk. Stops counting once past `stop_above`. Exact for valid JSON; for
    invalid JSON at least the depth a parser reaches before its first error (in the part a
    parser accepts, strings are delimited exactly as here)."""
    structure = _STRING.sub(b"", data)
    level = deepest = 0
    for start in range(0, len(structure), _CHUNK):
        chunk = np.frombuffer(structure, np.uint8, min(_CHUNK, len(structure) - start), start)
        run = np.cumsum(_STEP[chunk], dtype=np.int64) + level
        deepest, level = max(deepest, int(run.max())), int(run[-1])
        if stop_above is not None and deepest > stop_above:
            break
    return deepest


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not allowed")


def _strict_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:30]} is out of range")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {show(key, 40)}")
            seen.add(key)
    return result


def _check_strings(node: Any) -> None:
    """Reject lone surrogates: valid JSON escapes that no UTF-8 writer can encode again."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def load_json(data: Any, limits: JSONLimits, error: type[CorruptObject] = BadJSON) -> dict:
    """Parse one JSON object under `limits`; raise `error` (default BadJSON), one line, if not.

    Refused: non-bytes, more than `limits.max_bytes`, invalid UTF-8, nesting deeper than
    `limits.max_depth` (measured before parsing, so the parser never recurses deeper), NaN,
    Infinity and numbers that overflow a float, integers of more than `max_int_digits` digits,
    duplicate keys, lone surrogates, and a top level that is not an object.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise error(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > limits.max_bytes:
        raise error(f"{len(data)} bytes is over the {limits.max_bytes}-byte limit")
    if nesting_depth(data, stop_above=limits.max_depth) > limits.max_depth:
        raise error(f"JSON nested deeper than {limits.max_depth} levels")

    def strict_int(text: str) -> int:
        if len(text.lstrip("-")) > limits.max_int_digits:
            raise ValueError(f"an integer of {len(text)} digits is too long")
        return int(text)

    try:
        obj = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_reject_constant,
            parse_float=_strict_float,
            parse_int=strict_int,
        )
        _check_strings(obj)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeError: ValueErrors
        raise error(f"not valid JSON ({one_line(exc, 120)})") from None
    if not isinstance(obj, dict):
        raise error(f"not a JSON object (a {type(obj).__name__})")
    return obj


def _finite_or_none(node: Any) -> Any:
    if isinstance(node, float):
        return node if math.isfinite(node) else None
    if isinstance(node, dict):
        return {k: _finite_or_none(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_finite_or_none(v) for v in node]
    return node


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def dump_json(obj: Any) -> bytes:
    """The one encoding of store objects: sorted keys, compact, UTF-8. numpy scalars and arrays
    become numbers and lists; NaN and infinities become null, so that `load_json` (which refuses
    them) reads back everything written here (a diverged loss reads as None)."""
    plain = json.loads(json.dumps(obj, default=_json_default))
    return json.dumps(
        _finite_or_none(plain), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()
