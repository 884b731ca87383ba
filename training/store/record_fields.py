"""The shared core of the store's strict record parsers: the base error, the field checker.

Every record an experiment's store holds (docs/STORE.md) has one parser: the merge side's in
training/store/merge_records.py (pseudo-gradient manifests, HEAD, fragment manifests, ledger,
quarantine), the islands' side in training/store/island_records.py (config, checkpoints,
heartbeats, metrics, done markers, round clock), the syncer's in
training/store/syncer_records.py (shard leases, run markers). Each parser takes the object's bytes (read
through `safejson.load_json` with the kind's caps, `load_object`) or an already loaded dict, and
returns the validated record or raises its own error type, a `BadRecord` (a `CorruptObject`) with
a one-line reason. Nothing else escapes, whatever the input: the property tests in
tests/test_fuzz_records.py hold every parser to that. Values in messages are shortened (`show`),
so a hostile megabyte never ends up in a log line or a quarantine reason. The checks all parsers
share live here (`Fields`, `is_int`, `is_real`, `checksum_field`), so their strictness stays alike.

Names are parsed by `training.store.keys`; JSON by `training.store.safejson`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from training.store import safejson
from training.store.keys import is_name
from training.store.objectstore import CorruptObject
from training.store.safejson import JSONLimits, one_line, show


class BadRecord(CorruptObject):
    """Base of the per-kind record errors."""


MAX_COUNT = 2**53  # steps, tokens, bytes: exact as floats, far above anything real
SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)
CHECKSUM_PATTERNS = {"crc32c": re.compile(r"[0-9a-f]{8}", re.ASCII), "sha256": SHA256}
"""The payload checksums a manifest may carry (tensors.CHECKSUMS), each under its own key."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


class Fields:
    """Checked access to one JSON object's fields; every failure raises `error` with
    "`what`: reason" (just the reason when `what` is empty)."""

    def __init__(self, obj: Mapping[str, Any], error: type[CorruptObject], what: str = ""):
        self.obj, self.error, self.what = obj, error, what

    def fail(self, reason: str) -> NoReturn:
        raise self.error(one_line(f"{self.what}: {reason}" if self.what else reason))

    def get(
        self,
        key: str,
        check: Callable[[Any], bool],
        expected: str,
        optional: bool = False,
        nullable: bool = False,
    ) -> Any:
        """obj[key] if `check` holds; None if absent (`optional`) or null (`nullable`)."""
        if key not in self.obj:
            if optional:
                return None
            self.fail(f"missing {key!r}")
        value = self.obj[key]
        if value is None and nullable:
            return None
        if not check(value):
            self.fail(f"{key} {show(value)} is not {expected}")
        return value

    def int(self, key: str, lo: int = 0, hi: int = MAX_COUNT, **kw: bool) -> Any:
        return self.get(key, lambda v: is_int(v) and lo <= v <= hi, f"an int in [{lo}, {hi}]", **kw)

    def real(self, key: str, lo: float = -math.inf, **kw: bool) -> Any:
        return self.get(key, lambda v: is_real(v) and v >= lo, f"a finite number >= {lo}", **kw)

    def str(self, key: str, pattern: re.Pattern | None = None, max_len: int = 4096, **kw: bool):
        def ok(v: Any) -> bool:
            if not isinstance(v, str) or len(v) > max_len:
                return False
            return pattern is None or pattern.fullmatch(v) is not None

        return self.get(key, ok, "a valid string", **kw)

    def name(self, key: str, **kw: bool) -> Any:
        return self.get(key, is_name, "a name matching [a-z0-9][a-z0-9-]{0,62}", **kw)


def checksum_field(m: dict, f: Fields) -> tuple[str, Any]:
    """(algorithm, value) of the one checksum key of `m` (crc32c or sha256); f.fail if there
    is none or more than one."""
    present = [a for a in CHECKSUM_PATTERNS if a in m]
    if len(present) != 1:
        f.fail(f"needs exactly one checksum of {sorted(CHECKSUM_PATTERNS)}, has {present}")
    return present[0], m[present[0]]


def load_object(data: Any, limits: JSONLimits, error: type[CorruptObject], what: str) -> dict:
    """The JSON object of `data` (bytes, read under `limits`) or `data` itself (a dict)."""
    if isinstance(data, dict):
        return data
    try:
        return safejson.load_json(data, limits, error)
    except error as exc:
        raise error(one_line(f"{what}: {exc}")) from None
