"""A refused trigger-form value in one line: a root middleware of the api-server.

Airflow answers a trigger whose value breaks its Param's JSON schema with 400 and a detail of
jsonschema's whole report: the first line says what is wrong, then the schema and the instance
are dumped ("Failed validating 'pattern' in schema: {...} On instance: ..."), and the trigger
form shows that dump at its top. `OneLineParamErrors` keeps the first line only, on `POST
/api/v2/dags/<dag>/dagRuns` answers of 400 whose detail is such a report (any DAG's; nothing
else is touched, and a body it cannot read passes unchanged).
"""

from __future__ import annotations

import json
import re

TRIGGER_PATH = re.compile(r"^/api/v2/dags/[^/]+/dagRuns/?$")
PREFIX = "Invalid input for param "
MAX_CHARS = 400


def one_line(detail: str) -> str:
    """The first line of a Param validation report, bounded; other text as it is."""
    if not detail.startswith(PREFIX):
        return detail
    first = detail.strip().splitlines()[0].strip()
    return first if len(first) <= MAX_CHARS else first[: MAX_CHARS - 3] + "..."


def rewrite(body: bytes) -> bytes | None:
    """The body with its `detail` in one line, or None when there is nothing to rewrite."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    detail = data.get("detail") if isinstance(data, dict) else None
    if not isinstance(detail, str) or one_line(detail) == detail:
        return None
    return json.dumps({**data, "detail": one_line(detail)}).encode()


class OneLineParamErrors:
    """Pure ASGI middleware (no Starlette response buffering for other requests)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if (
            scope.get("type") != "http"
            or scope.get("method") != "POST"
            or not TRIGGER_PATH.match(scope.get("path", ""))
        ):
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def capture(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] == 400:
                start = message  # held back until the whole body is read
                return
            if start is None:
                return await send(message)
            if message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                body = b"".join(chunks)
                new = rewrite(body)
                headers = start.get("headers", [])
                if new is not None:
                    body = new
                    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
                    headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, capture)
