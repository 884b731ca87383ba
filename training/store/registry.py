"""Which backend serves a store URL: `open_store("file:///...", "gs://...", "memory://...")`.

Kept apart from the interface (`objectstore.py`) so that the backends import the interface and
the interface imports no backend: no import cycle. A backend's module is imported only when a URL
asks for it, so file:// users never load the Google client libraries.
"""

from __future__ import annotations

import os

from training.store.objectstore import ObjectStore


def open_store(url: str | os.PathLike[str]) -> ObjectStore:
    """Open "file:///abs/path", a plain path, "gs://bucket[/prefix]" or "memory://name".

    Nothing is contacted here; call `check()` to verify reachability.
    """
    text = os.fspath(url)
    if text.startswith("gs://"):
        from training.store.gcs import GCSStore  # the Google client libraries load only here

        bucket, _, prefix = text[len("gs://") :].partition("/")
        return GCSStore(bucket, prefix)
    if text.startswith("memory://"):
        from training.store.memory import MemoryStore

        return MemoryStore(text[len("memory://") :])
    from training.store.local import LocalStore

    if text.startswith("file://"):
        path = text[len("file://") :]
        if not path.startswith("/"):
            raise ValueError(f"invalid store URL {text!r}: file:// URLs need an absolute path")
        return LocalStore(path)
    if "://" in text:
        raise ValueError(f"unsupported store URL {text!r}: use file://, gs:// or memory://")
    return LocalStore(text)
