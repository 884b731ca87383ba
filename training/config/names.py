"""Names of experiments and islands: one rule, usable in paths, GCS object names and task ids."""

from __future__ import annotations

import re

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
MAX_NAME_LENGTH = 63


def _reason(value: str) -> str:
    """One-line reason why `value` does not match NAME_PATTERN."""
    if not value:
        return "empty"
    if "/" in value or "\\" in value:
        return "contains a path separator"
    if ".." in value:
        return "contains '..'"
    if len(value) > MAX_NAME_LENGTH:
        return f"too long ({len(value)} > {MAX_NAME_LENGTH} characters)"
    if any(c.isupper() for c in value):
        return "contains uppercase letters"
    if value[0] == "-":
        return "starts with '-'"
    bad = sorted({c for c in value if not (c.isascii() and (c.isalnum() or c == "-"))})
    return f"contains characters outside [a-z0-9-]: {''.join(bad)!r}"


def validate_name(kind: str, value: str) -> str:
    """Return `value` if it matches ^[a-z0-9][a-z0-9-]{0,62}$, else raise ValueError.

    `kind` ("experiment", "island", ...) only appears in the error message.
    """
    if not isinstance(value, str):
        raise ValueError(f"invalid {kind} name {value!r}: not a string")
    if NAME_PATTERN.fullmatch(value) is None:
        raise ValueError(f"invalid {kind} name {value!r}: {_reason(value)}")
    return value
