"""`diloco bench device`: the card's own rates, and the device check's plan and JSON
(training/bench/device_check.py: its parts, the MFU and the model FLOPs per token behind it; run
by devtools/device_check.sh).

    diloco bench device rates --json FILE [--matmul N] [--copy-mib M] [--encode-elems E]
        [--encode-tensors T] [--codecs int8 int4]
    diloco bench device plan {gpu,cpu} --work DIR [--quality-tokens N]
    diloco bench device assemble --work DIR --json FILE [--profile gpu] [--budget-s S]

`python -m training.bench.device ...` is the same without training/cli.py's imports (pydantic):
the script plans and assembles that way, so that its JSON is written even where they fail.

`rates` measures, on JAX's default device, in this order, writing the JSON after each (a
measurement that fails is recorded as {"error": ...} and the next one runs):
- the device and the versions of the packages the project imports;
- the matrix rate: an N x N x N matmul in bfloat16 and in float32 (JAX's default precision),
  jitted, 3 warm-up products then the mean of 10 dispatched back to back (one wait at the end);
  2 N^3 FLOPs each;
- the copy bandwidth: an elementwise pass (x + 1) over an M MiB float32 array, timed like the
  matmul; bytes read + written per second (an elementwise pass moves what a copy moves);
- the device codec: `DeviceEncoder(codec).encode` (training/island/encode.py: pseudo-gradient,
  quantization and error feedback in one jitted computation) of an E-element pseudo-gradient in T
  equal float32 tensors, with a residual (the steady state), best of 3 after a compiling call,
  waiting for every output; `encode_bytes_per_s` = 4 E / seconds (the fp32 pseudo-gradient's
  bytes), `vs_copy` = the seconds the measured copy bandwidth needs to copy those bytes (read +
  write) / the encode's seconds.

Module-level imports are the standard library's: JAX is imported by the measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from training.bench import device_check

VERSIONS = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "numpy",
    "ml_dtypes",
    "pydantic",
    "pydantic_core",
    "google-crc32c",
    "safetensors",
    "fsspec",
    "scipy",
)


def _timed(fn, *args, warmup: int = 3, repeats: int = 10) -> float:
    """Mean seconds of `fn(*args)` over `repeats` calls dispatched back to back (one wait at
    the end), after `warmup` calls (the first compiles)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    out = None
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / repeats


def matmul_rate(n: int, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    seconds = _timed(jax.jit(jnp.matmul), a, b)
    return dict(n=n, dtype=dtype, seconds=seconds, flops_per_s=2 * n**3 / seconds)


def copy_rate(nbytes: int) -> dict:
    import jax
    import jax.numpy as jnp

    x = jnp.zeros(max(1, nbytes // 4), jnp.float32)
    seconds = _timed(jax.jit(lambda v: v + 1.0), x)
    moved = 2 * x.nbytes  # read + written
    return dict(bytes=x.nbytes, seconds=seconds, bytes_per_s=moved / seconds)


def encode_rate(codec: str, elems: int, tensors: int, copy_bytes_per_s: float | None) -> dict:
    """DeviceEncoder(codec).encode of `elems` float32 elements in `tensors` equal tensors."""
    import jax
    import jax.numpy as jnp

    from training.island.encode import DeviceEncoder

    per = -(-elems // tensors)
    names = [f"t{i:02d}" for i in range(tensors)]
    keys = jax.random.split(jax.random.key(1), 3 * tensors)
    local = {n: jax.random.normal(keys[i], (per,), jnp.float32) for i, n in enumerate(names)}
    anchor = {
        n: local[n] + 1e-3 * jax.random.normal(keys[tensors + i], (per,), jnp.float32)
        for i, n in enumerate(names)
    }
    residual = {
        n: 1e-4 * jax.random.normal(keys[2 * tensors + i], (per,), jnp.float32)
        for i, n in enumerate(names)
    }
    jax.block_until_ready((local, anchor, residual))
    encoder = DeviceEncoder(codec)
    out = encoder.encode(anchor, local, residual)  # compiles
    jax.block_until_ready(out)
    payload_bytes = sum(int(v.size) * v.dtype.itemsize for v in out[0].values())
    del out
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        out = encoder.encode(anchor, local, residual)
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t)
        del out
    nbytes = 4 * per * tensors
    row = dict(
        codec=codec,
        elems=per * tensors,
        tensors=tensors,
        encode_s=best,
        pseudograd_bytes=nbytes,
        payload_bytes=payload_bytes,
        encode_bytes_per_s=nbytes / best,
        vs_copy=None,
    )
    if copy_bytes_per_s:
        row["vs_copy"] = (2 * nbytes / copy_bytes_per_s) / best
    return row


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict:
    import jax

    dev = jax.devices()[0]
    info = dict(
        device=f"{jax.default_backend()}: {dev.device_kind}",
        backend=jax.default_backend(),
        device_kind=dev.device_kind,
        device_count=jax.device_count(),
        host=platform.node(),
        cpu_count=os.cpu_count(),
        versions=versions(),
    )
    try:
        stats = dev.memory_stats() or {}
        info["device_memory_bytes"] = stats.get("bytes_limit")
    except Exception:  # not every backend has memory statistics
        info["device_memory_bytes"] = None
    try:
        from training.codecs import native

        info["native_codecs"] = native.library() is not None
    except Exception as exc:  # the host codecs' C loops are informative only
        info["native_codecs"] = f"error: {type(exc).__name__}: {exc}"
    return info


def _attempt(fn, *args) -> dict:
    """fn(*args), or {"error": one line} (a failed measurement does not stop the others)."""
    try:
        return fn(*args)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return {"error": f"{type(exc).__name__}: {first}"[:500]}


def rates(args) -> int:
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    out: dict = dict(date=datetime.now(UTC).isoformat(timespec="seconds"), **device_info())
    path.write_text(json.dumps(out, indent=1))
    print(f"device {out['device']} ({out['device_count']} device(s))", flush=True)

    def save(key: str, value) -> None:
        out[key] = value
        path.write_text(json.dumps(out, indent=1))

    for dtype in ("bfloat16", "float32"):
        r = _attempt(matmul_rate, args.matmul, dtype)
        save(f"matmul_{dtype}", r)
        if "error" not in r:
            print(f"matmul {dtype} {args.matmul}^3: {r['flops_per_s'] / 1e12:.1f} TFLOP/s")
    c = _attempt(copy_rate, args.copy_mib * 2**20)
    save("copy", c)
    copy_bps = c.get("bytes_per_s")
    if copy_bps:
        print(f"copy {args.copy_mib} MiB: {copy_bps / 1e9:.1f} GB/s (read + written)", flush=True)
    encodes = []
    for codec in args.codecs:
        r = _attempt(encode_rate, codec, args.encode_elems, args.encode_tensors, copy_bps)
        encodes.append(r)
        save("encode", encodes)
        if "error" not in r:
            vs = f", {r['vs_copy']:.2f}x a copy's speed" if r["vs_copy"] else ""
            print(
                f"device encode {codec} of {r['elems']:,} elements: {r['encode_s'] * 1e3:.1f} ms, "
                f"{r['encode_bytes_per_s'] / 1e9:.1f} GB/s{vs}",
                flush=True,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="diloco bench device", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sp = sub.add_parser("rates", help="matrix rate, copy bandwidth, device-codec encode rate")
    sp.add_argument("--json", required=True)
    sp.add_argument("--matmul", type=int, default=8192, help="N of the N x N x N products")
    sp.add_argument("--copy-mib", type=int, default=4096)
    sp.add_argument("--encode-elems", type=int, default=10**9)
    sp.add_argument("--encode-tensors", type=int, default=16)
    sp.add_argument("--codecs", nargs="+", default=["int8", "int4"])
    sp = sub.add_parser("plan", help="the parts of devtools/device_check.sh, one a line")
    sp.add_argument("profile", choices=device_check.PROFILES)
    sp.add_argument("--work", required=True, help="the directory the parts write into")
    sp.add_argument("--quality-tokens", type=int, default=None)
    sp = sub.add_parser("assemble", help="one JSON out of the parts in a work directory")
    sp.add_argument("--work", required=True)
    sp.add_argument("--json", required=True)
    sp.add_argument("--profile", choices=device_check.PROFILES, default="gpu")
    sp.add_argument("--budget-s", type=float, default=None)
    args = ap.parse_args(argv)
    if args.what == "rates":
        for flag in ("matmul", "copy_mib", "encode_elems", "encode_tensors"):
            if getattr(args, flag) < 1:
                ap.error(f"--{flag.replace('_', '-')} must be >= 1")
        return rates(args)
    if args.what == "plan":
        if args.quality_tokens is not None and args.quality_tokens < 1:
            ap.error("--quality-tokens must be >= 1")
        for part in device_check.plan(args.profile, args.work, args.quality_tokens):
            print(part.line())
        return 0
    out = device_check.assemble(Path(args.work), args.profile, args.budget_s)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(device_check.format_rows(out["rows"]))
    for p in out["parts"]:
        print(f"part {p.get('name')}: {p.get('status')} ({p.get('seconds')} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
