"""The parts of devtools/device_check.sh, and the one JSON made of what they wrote.

Standard library only (the model sizes of the MFU excepted, imported when there): the script asks
for its plan and assembles its JSON with `python -m training.bench.device plan|assemble`, which
work even where a part's imports fail.

`plan(profile, work)`: the parts in priority order (the script cuts from the end when its time
runs out), each `python -m training.cli ARGV` with a timeout, writing `WORK/NAME.json`. The
`gpu` plan is sized for one H200 (16 cores) in about 8 minutes: the card's rates, `bench island`
for gemma-125m and gemma-1b in bfloat16 at P = 1 and 24 (the island's file:// store on local
disk, background publish, adopt, device encode and checkpoints; `--gc-keep 1` so that a 1b
store fits the disk), `bench merge` for 125m and 1b, the quality pair (data-parallel and
Decoupled DiLoCo, 4 islands, `bench quality` on gemma-125m) and gemma-125m in float32 for
reference. The `cpu` plan runs the same kinds of parts at tiny sizes (tests/test_bench_device.py).

`assemble(work)`: reads every `WORK/*.json` and `WORK/parts.jsonl` (the script's record of each
part: status ok / failed / timed_out / skipped, exit code, seconds, timeout, command) and returns
the check's JSON (schema: docs/BENCHMARKS.md, "On an accelerator"). MFU = model FLOPs per token
(`flops_per_token`, below) x tokens per second / the bfloat16 matrix rate measured in the same
run, for every row (the float32 rows too: against the card's bf16 rate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

SCHEMA = 1
PROFILES = ("gpu", "cpu")
GPU_QUALITY_TOKENS = 1_000_000  # a guess before any run: the JSON's wall_s says how to scale it
CPU_QUALITY_TOKENS = 4_000
FLOPS_FORMULA = "6 x (non-embedding params + vocab x d_model) + 12 x n_layers x seq_len x d_attn"


def flops_per_token(model, seq_len: int) -> int:
    """Training FLOPs per token of a preset model (forward + backward = 3 x forward):

        6 x (non-embedding parameters + vocab x d_model) + 12 x n_layers x seq_len x d_attn

    Non-embedding parameters: all but the token embedding (and the gpt family's position
    table), so every weight matrix of the blocks, at 2 FLOPs per weight per token forward; the
    tied output head is a vocab x d_model matmul and counts as such (the embedding lookup does
    no arithmetic). Attention (PaLM, appendix B): QK^T and AV are 2 x seq_len x d_attn each per
    token and layer forward, d_attn = n_heads x head_dim (= d_model in both families), counted
    over the whole sequence as the usual MFU convention does (a causal kernel may skip half).
    Norm scales count as parameters (a rounding error)."""
    if model.factory is not None:
        raise ValueError("flops_per_token: a model.factory model has no analytic count")
    m = model.dims()
    d, L, V = m["d_model"], m["n_layers"], m["vocab_size"]
    d_attn = m["n_heads"] * (d // m["n_heads"])
    embedding = V * d + (m["max_seq_len"] * d if model.family == "gpt" else 0)
    non_embedding = model.param_count() - embedding
    return 6 * (non_embedding + V * d) + 12 * L * seq_len * d_attn


@dataclass(frozen=True)
class Part:
    """One part of the check: `python -m training.cli *argv`, killed after `timeout_s`."""

    name: str
    timeout_s: int
    argv: tuple[str, ...]

    def line(self) -> str:
        """name, timeout and the arguments, tab-separated (the script splits the arguments on
        spaces, so none may hold whitespace)."""
        if any(c.isspace() for a in self.argv for c in a):
            raise ValueError(f"part {self.name}: an argument holds whitespace: {self.argv}")
        return f"{self.name}\t{self.timeout_s}\t{' '.join(self.argv)}"


def _island(work: str, name: str, preset: str, dtype: str, fragments, **sizes) -> tuple:
    args = ["bench", "island", "--json", f"{work}/{name}.json", "--presets", preset]
    args += ["--fragments", *map(str, fragments), "--compute-dtype", dtype, "--gc-keep", "1"]
    for flag in ("seq_len", "batch_size", "H", "repeats"):
        args += [f"--{flag.replace('_', '-')}", str(sizes[flag])]
    return tuple(args)


def _merge(work: str, name: str, preset: str, fragments, codec_elems: int | None = None):
    args = ["bench", "merge", "--json", f"{work}/{name}.json", "--presets", preset]
    args += ["--fragments", *map(str, fragments)]
    if codec_elems is not None:
        args += ["--codec-elems", str(codec_elems)]
    return tuple(args)


def _quality(work: str, name: str, methods: str, tokens: int, sets: list[str]) -> tuple:
    args = ["bench", "quality", "--size", "quick", "--methods", methods, "--tokens", str(tokens)]
    for s in sets:
        args += ["--set", s]
    return (*args, "--json", f"{work}/{name}.json")


def _rates(work: str, *sizes: str) -> tuple:
    return ("bench", "device", "rates", "--json", f"{work}/rates.json", *sizes)


def plan(profile: str, work: str, quality_tokens: int | None = None) -> list[Part]:
    """The parts in priority order (see the module docstring)."""
    if profile == "gpu":
        tokens = quality_tokens or GPU_QUALITY_TOKENS
        q = ["model.preset=gemma-125m", "model.compute_dtype=bfloat16"]
        s125 = dict(seq_len=1024, batch_size=16, H=24, repeats=3)
        s1b = dict(seq_len=1024, batch_size=8, H=8, repeats=2)
        return [
            Part("rates", 75, _rates(work, "--matmul", "8192", "--copy-mib", "4096",
                                     "--encode-elems", str(10**9), "--encode-tensors", "16")),
            Part("island-125m-bf16", 100, _island(work, "island-125m-bf16", "gemma-125m",
                                                  "bfloat16", (1, 24), **s125)),
            Part("island-1b-bf16", 150, _island(work, "island-1b-bf16", "gemma-1b", "bfloat16",
                                                (24, 1), **s1b)),
            Part("merge-125m", 60, _merge(work, "merge-125m", "125m", (24, 1))),
            Part("merge-1b-p24", 40, _merge(work, "merge-1b-p24", "1b", (24,))),
            Part("quality-decoupled", 75, _quality(work, "quality-decoupled", "decoupled",
                                                   tokens, q)),
            Part("quality-dp", 45, _quality(work, "quality-dp", "dp", tokens, q)),
            Part("island-125m-fp32", 70, _island(work, "island-125m-fp32", "gemma-125m",
                                                 "float32", (1, 24), **{**s125, "repeats": 2})),
            Part("merge-1b-p1", 90, _merge(work, "merge-1b-p1", "1b", (1,))),
        ]  # fmt: skip
    if profile == "cpu":
        tokens = quality_tokens or CPU_QUALITY_TOKENS
        q = ["model.preset=gemma-tiny", "data.seq_len=16", "data.batch_size=2", "inner.H=4"]
        tiny = dict(seq_len=16, batch_size=2, H=2, repeats=1)
        return [
            Part("rates", 60, _rates(work, "--matmul", "128", "--copy-mib", "4",
                                     "--encode-elems", str(2**16), "--encode-tensors", "4")),
            Part("island-tiny-bf16", 120, _island(work, "island-tiny-bf16", "gemma-tiny",
                                                  "bfloat16", (1, 2), **tiny)),
            Part("merge-tiny", 60, _merge(work, "merge-tiny", "tiny", (1,), codec_elems=2**16)),
            Part("quality-pair", 120, _quality(work, "quality-pair", "decoupled,dp", tokens, q)),
        ]  # fmt: skip
    raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _parts(work: Path) -> list[dict]:
    try:
        lines = (work / "parts.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({"unreadable": line[:200]})
    return out


def _rate(rates: dict | None, key: str, field: str) -> float | None:
    value = (rates or {}).get(key)
    got = value.get(field) if isinstance(value, dict) else None
    return float(got) if isinstance(got, int | float) and got > 0 else None


def _flops(preset: str, seq_len: int) -> int | None:
    try:
        from training.config.experiment import ModelConfig

        return flops_per_token(ModelConfig(preset=preset), seq_len)
    except Exception:  # no pydantic here, or an unknown preset: no MFU, the rest stands
        return None


def island_row(r: dict, peak: float | None, part: str) -> dict:
    """The check's row of one measured `bench island` row (`overhead`: a fraction)."""
    tokens = r["seq_len"] * r["batch_size"]
    island_tps, bare_tps = tokens / r["island_step_s"], tokens / r["bare_step_s"]
    fpt = _flops(r["preset"], r["seq_len"])
    return dict(
        preset=r["preset"],
        fragments=r["fragments"],
        compute_dtype=r["compute_dtype"],
        seq_len=r["seq_len"],
        batch_size=r["batch_size"],
        tokens_per_step=tokens,
        H=r["H"],
        repeats=r["repeats"],
        every_rounds=r["every_rounds"],
        island_tokens_per_s=island_tps,
        bare_tokens_per_s=bare_tps,
        overhead=r["overhead"],
        overhead_pct=100 * r["overhead"],
        overhead_spread=r.get("overhead_spread"),
        cpu_ratio=r.get("cpu_ratio"),
        breakdown_share=r.get("breakdown_share"),
        flops_per_token=fpt,
        mfu=fpt * island_tps / peak if fpt and peak else None,
        bare_mfu=fpt * bare_tps / peak if fpt and peak else None,
        device=r["device"],
        part=part,
    )


def _merge_rows(files: dict[str, dict]) -> list[dict]:
    """Every measured row; a computed row only where no part measured its (preset, P), once."""
    rows = [
        dict(r, part=n)
        for n, d in files.items()
        if n.startswith("merge-")
        for r in d.get("rows", [])
        if isinstance(r, dict) and "preset" in r and "fragments" in r
    ]
    measured = {(r["preset"], r["fragments"]) for r in rows if r.get("measured")}
    kept, seen = [], set()
    for r in rows:
        key = (r["preset"], r["fragments"])
        if r.get("measured") or (key not in measured and key not in seen):
            kept.append(r)
            seen.add(key)
    return kept


def _quality_pair(files: dict[str, dict]) -> dict:
    methods: dict[str, dict] = {}
    model = budget = None
    for name, data in files.items():
        if not name.startswith("quality-"):
            continue
        model, budget = data.get("model", model), data.get("token_budget", budget)
        for method, r in (data.get("methods") or {}).items():
            methods[method] = {
                k: r.get(k) for k in ("eval_loss", "tokens", "wall_s", "merges", "bytes_sent")
            }
    dp, dec = methods.get("dp", {}).get("eval_loss"), methods.get("decoupled", {}).get("eval_loss")
    vs = 100 * (dec - dp) / dp if dp and dec is not None else None
    return dict(model=model, token_budget=budget, methods=methods, decoupled_vs_dp_pct=vs)


def assemble(work: Path, profile: str, budget_s: float | None) -> dict:
    files = {p.stem: _load(p) for p in sorted(work.glob("*.json"))}
    files = {k: v for k, v in files.items() if v is not None}
    rates = files.get("rates") or {}
    peak = _rate(rates, "matmul_bfloat16", "flops_per_s")
    rows, errors = [], []
    for name, data in files.items():
        for r in data.get("rows", []) if name.startswith("island-") else []:
            if isinstance(r, dict) and not r.get("computed"):
                try:
                    rows.append(island_row(r, peak, name))
                except (KeyError, TypeError, ZeroDivisionError) as exc:
                    errors.append(f"{name}: unreadable row ({type(exc).__name__}: {exc})")
    merges = [d for n, d in files.items() if n.startswith("merge-")]
    codecs = next((d["codecs"] for d in merges if d.get("codecs")), [])  # a cut part has none
    parts = _parts(work)
    return dict(
        schema=SCHEMA,
        profile=profile,
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        device=rates.get("device") or next((r["device"] for r in rows), "unknown"),
        device_info={k: v for k, v in rates.items() if not isinstance(v, dict | list)},
        versions=rates.get("versions"),
        budget_s=budget_s,
        parts=parts,
        ok=bool(parts) and all(p.get("status") == "ok" for p in parts) and not errors,
        errors=errors,
        flops_per_token_formula=FLOPS_FORMULA,
        rates=dict(
            matmul_bfloat16_flops_per_s=peak,
            matmul_float32_flops_per_s=_rate(rates, "matmul_float32", "flops_per_s"),
            copy_bytes_per_s=_rate(rates, "copy", "bytes_per_s"),
        ),
        encode=rates.get("encode", []),
        rows=rows,
        merge=_merge_rows(files),
        merge_codecs=codecs,
        quality=_quality_pair(files),
        raw=files,
    )


def format_rows(rows: list[dict]) -> str:
    head = (
        f"{'preset':11s} {'P':>3s} {'dtype':9s} {'island tok/s':>13s} {'bare tok/s':>13s} "
        f"{'overhead':>9s} {'MFU':>6s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        lines.append(
            f"{r['preset']:11s} {r['fragments']:3d} {r['compute_dtype']:9s} "
            f"{r['island_tokens_per_s']:13,.0f} {r['bare_tokens_per_s']:13,.0f} "
            f"{r['overhead']:+9.2%} {mfu:>6s}"
        )
    return "\n".join(lines)
