"""The 12B figure, computed: step time, traffic and speed-ups of a 12B model trained across regions.

Everything here is arithmetic on stated assumptions (`Assumptions`, every field documented in
docs/WAN.md) plus two throughputs of this machine measured on request: the int4 encode speed of
`training.codecs.host` and the merge throughput (from a `diloco bench merge --json` file when given,
else numpy's memcpy bandwidth here, an upper bound for a merge, which must at least move its
bytes). Nothing imports jax.

Per step of one island (one region), with N parameters, M regions, P fragments, H inner steps:
- compute: `T_c = flops_per_token x tokens_per_island_step / (chips x peak x MFU)`,
  `flops_per_token = 6 N' + 12 L d T` (PaLM's count; N' leaves out the position table);
- data-parallel: a ring all-reduce of bf16 gradients over the regions every step, each region
  sending and receiving `2 (M-1)/M x 2 N` bytes; its step covers M x the island batch;
- Decoupled DiLoCo: each fragment (N/P parameters) goes up once every H steps as an int4
  pseudo-gradient and comes down once as the merged fragment (codec `down_codec`); per step that
  is `N x bytes_per_param / H` each way, independent of P. Transfers overlap compute when the
  island sends in the background (the paper's design, `overlap=True`); this project's island
  today transfers in line with its steps (`overlap=False`);
- synchronous DiLoCo: every H steps all islands stop, send the whole pseudo-gradient, wait for
  the merge of all P fragments and take the whole model back.
Speed-ups compare time per token (equal tokens, and the papers' claim of equal loss).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from training.config.experiment import GEMMA_PRESETS, PRESETS, ModelConfig

GBPS = (2.0, 3.0, 5.0)
PRESET_NAMES = (*PRESETS, *GEMMA_PRESETS)


@dataclass(frozen=True)
class Chip:
    name: str
    peak_bf16_flops: float  # per chip, dense bf16
    hbm_bytes: float
    source: str


CHIPS = {
    "v5p": Chip("TPU v5p", 459e12, 95e9, "cloud.google.com/tpu/docs/v5p (459 TFLOPS bf16, 95 GB)"),
    "v6e": Chip("TPU v6e", 918e12, 32e9, "cloud.google.com/tpu/docs/v6e (918 TFLOPS bf16, 32 GB)"),
}

# bytes per parameter on the wire, int4 with one float32 scale per 256-element block (codecs.py);
# "fp32+outer_state" is what an island downloads today: the parameters and the outer momentum
CODEC_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "int8": 1.0 + 4 / 256,
    "int4": 0.5 + 4 / 256,
    "fp32+outer_state": 8.0,
}
DOWNLOADS = ("int4", "bf16", "fp32", "fp32+outer_state")


@dataclass(frozen=True)
class Assumptions:
    """Every input of the 12B figure (docs/WAN.md explains each)."""

    preset: str = "12b"
    chip: str = "v5p"
    chips_per_island: int = 256
    mfu: float = 0.40
    regions: int = 4  # islands, one per region
    tokens_per_island_step: int = 256 * 4096  # 1M tokens: 256 sequences of 4096
    fragments: int = 24  # P
    H: int = 24
    up_codec: str = "int4"
    down_codec: str = "int4"  # the merged fragment as sent down (see docs/WAN.md)
    # updates each island downloads per fragment and round: 1 when one version per round
    # holds every island's contribution (a quorum of all, or a grace window that catches
    # them); up to `regions` with quorum 1, each island's contribution a version of its own
    # (the update broadcast reads every version's update: docs/WAN.md "Latency scaled")
    downloads_per_round: int = 1
    dp_grad_bytes: float = 2.0  # bf16 gradients
    merge_bytes_per_s: float = 10e9  # the syncer's merge throughput (bytes moved per second)
    merge_source: str = "assumed"
    encode_bytes_per_s: float = 1e9  # island-side codec throughput (float32 bytes in per second)
    encode_source: str = "assumed"


def model_numbers(preset: str) -> dict:
    cfg = ModelConfig(preset=preset)
    m = cfg.dims()
    n = cfg.param_count()
    positions = m["max_seq_len"] * m["d_model"] if cfg.family == "gpt" else 0  # gemma: rotary
    flops = 6 * (n - positions) + 12 * m["n_layers"] * m["d_model"] * m["max_seq_len"]
    return dict(params=n, flops_per_token=flops, **m)


def step_time(a: Assumptions) -> float:
    """Compute seconds of one island step."""
    chip = CHIPS[a.chip]
    flops = model_numbers(a.preset)["flops_per_token"] * a.tokens_per_island_step
    return flops / (a.chips_per_island * chip.peak_bf16_flops * a.mfu)


def dp_bytes_per_step(a: Assumptions, regions: int | None = None) -> float:
    """Bytes each region sends (and receives) per data-parallel step: a ring all-reduce."""
    m = regions or a.regions
    return 2 * (m - 1) / m * a.dp_grad_bytes * model_numbers(a.preset)["params"]


def comm_ratio(a: Assumptions, gbps: float, regions: int | None = None) -> float:
    """Data-parallel communication time over compute time per step at `gbps` per region."""
    return dp_bytes_per_step(a, regions) * 8 / (gbps * 1e9) / step_time(a)


def merge_seconds(a: Assumptions, fragments: int = 1) -> float:
    """Seconds the syncer needs to merge `fragments` fragments from every region: read the
    contributions, read and write the fragment's parameters and outer momentum (float32)."""
    n = model_numbers(a.preset)["params"] / a.fragments * fragments
    moved = a.regions * n * CODEC_BYTES[a.up_codec] + 4 * n * 4
    return moved / a.merge_bytes_per_s


def figure(a: Assumptions, gbps: float, overlap: bool = True) -> dict:
    """Step times, needed bandwidth and speed-ups at `gbps` per region (each way)."""
    n = model_numbers(a.preset)["params"]
    t_c = step_time(a)
    link = gbps * 1e9 / 8  # bytes per second each way
    up = n * CODEC_BYTES[a.up_codec] / a.H  # per island per step (average)
    down = n * CODEC_BYTES[a.down_codec] * a.downloads_per_round / a.H
    # host-side encoding blocks the step only when transfers are in line (on device otherwise)
    encode = 0.0 if overlap else n * 4 / a.H / a.encode_bytes_per_s
    # data-parallel: M x the island batch per step, all-reduce after the backward pass
    t_dp = t_c + dp_bytes_per_step(a) / link
    # decoupled: transfers in the background (overlap) or in line with the steps
    if overlap:
        t_dec = max(t_c, up / link, down / link)
    else:
        t_dec = t_c + encode + up / link + down / link
    # the syncer merges P/H fragments per step; shards split the fragments between them
    per_step_merge = merge_seconds(a, 1) * a.fragments / a.H
    shards = max(1, math.ceil(per_step_merge / t_c))
    # synchronous DiLoCo: every H steps, everyone waits for the whole round trip
    round_trip = n * CODEC_BYTES[a.up_codec] / link + merge_seconds(a, a.fragments) / shards
    round_trip += n * CODEC_BYTES[a.down_codec] / link
    t_sync = t_c + (encode * a.H + round_trip) / a.H
    return dict(
        gbps=gbps,
        step_s=t_c,
        dp_step_s=t_dp,
        decoupled_step_s=t_dec,
        sync_step_s=t_sync,
        island_gbps_up=up * 8 / t_c / 1e9,
        island_gbps_down=down * 8 / t_c / 1e9,
        syncer_gbps_in=a.regions * up * 8 / t_c / 1e9,
        syncer_gbps_out=a.regions * down * 8 / t_c / 1e9,
        merge_s_per_fragment=merge_seconds(a, 1),
        syncer_shards=shards,
        speedup_vs_dp=t_dp / t_dec,
        speedup_vs_sync=t_sync / t_dec,
        dp_comm_ratio=comm_ratio(a, gbps),
        overlap=overlap,
    )


# -- measured throughputs -------------------------------------------------------------------


def measure_memcpy(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Best-of-`repeats` numpy copy bandwidth of this machine, bytes copied per second."""
    import numpy as np

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def measure_encode(elements: int = 1 << 22, codec: str = "int4") -> float:
    """Float32 bytes per second that `training.codecs.host.encode` (with error feedback) takes in."""
    import numpy as np

    from training.codecs import host as codecs

    x = {"w": np.random.default_rng(0).standard_normal(elements, dtype=np.float32)}
    t = time.perf_counter()
    codecs.encode(x, codec, {"w": np.zeros(elements, np.float32)})
    return elements * 4 / (time.perf_counter() - t)


def merge_throughput_from(path: str | Path) -> tuple[float, str]:
    """Bytes per second from a `diloco bench merge --json` file: its rows' total `bytes_moved`
    over their total `seconds`, preferring the rows of the largest preset (and of an
    `--at-size` file, its warm merges). Raises ValueError."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read merge rows from {path}: {err}") from None
    ok = [
        r
        for r in rows
        if isinstance(r, dict)
        and isinstance(r.get("seconds"), int | float)
        and isinstance(r.get("bytes_moved"), int | float)
        and r["seconds"] > 0
    ]
    if not ok:
        raise ValueError(f"{path}: no rows with seconds > 0 and bytes_moved")
    presets_seen = {str(r.get("preset")) for r in ok} & set(PRESET_NAMES)
    sizes = {p: ModelConfig(preset=p).param_count() for p in presets_seen}
    if sizes:
        biggest = max(sizes, key=sizes.get)
        ok = [r for r in ok if r.get("preset") == biggest] or ok
    # `--at-size` rows (training/bench/merge_size.py): the warm merges (the syncer's state
    # resident), measured at the real size
    ok = [r for r in ok if r.get("kind", "warm") == "warm"] or ok
    rate = sum(r["bytes_moved"] for r in ok) / sum(r["seconds"] for r in ok)
    presets = sorted({str(r.get("preset")) for r in ok})
    return rate, f"{Path(path).name}: {len(ok)} rows of preset {', '.join(presets)}"


def measured_assumptions(merge_json: str | None = None, **overrides) -> Assumptions:
    """Assumptions with this machine's codec throughput and the merge throughput filled in."""
    if merge_json:
        merge, merge_src = merge_throughput_from(merge_json)
    else:
        merge = measure_memcpy()
        merge_src = "numpy memcpy bandwidth of this machine (upper bound for a merge)"
    enc = measure_encode()
    base = Assumptions(
        merge_bytes_per_s=merge,
        merge_source=merge_src,
        encode_bytes_per_s=enc,
        encode_source="training.codecs.host int4 encode with error feedback, numpy, one core here",
    )
    return replace(base, **overrides)


def by_download(a: Assumptions, gbps: float) -> list[dict]:
    """Speed-ups at `gbps` for each way of sending the merged fragment down, both transfer modes."""
    out = []
    for down in DOWNLOADS:
        for overlap in (True, False):
            f = figure(replace(a, down_codec=down), gbps, overlap)
            out.append(
                dict(
                    down_codec=down,
                    overlap=overlap,
                    island_gbps_down=f["island_gbps_down"],
                    speedup_vs_dp=f["speedup_vs_dp"],
                    speedup_vs_sync=f["speedup_vs_sync"],
                )
            )
    return out


def report(a: Assumptions, gbps=GBPS) -> dict:
    rows = [figure(a, g, overlap) for overlap in (True, False) for g in gbps]
    nums = model_numbers(a.preset)
    return dict(
        assumptions=asdict(a),
        chip=asdict(CHIPS[a.chip]),
        model=nums,
        step_s=step_time(a),
        dp_bytes_per_step=dp_bytes_per_step(a),
        fragment_bytes_up=nums["params"] / a.fragments * CODEC_BYTES[a.up_codec],
        fragment_bytes_down=nums["params"] / a.fragments * CODEC_BYTES[a.down_codec],
        rows=rows,
        by_download={str(g): by_download(a, g) for g in gbps},
    )


def format_report(rep: dict) -> str:
    a, m = rep["assumptions"], rep["model"]
    lines = [
        f"{a['preset']}: {m['params'] / 1e9:.2f}B parameters, {m['flops_per_token'] / 1e9:.1f} "
        f"GFLOP per token; {a['regions']} regions x {a['chips_per_island']} {rep['chip']['name']} "
        f"at {a['mfu']:.0%} MFU, {a['tokens_per_island_step'] / 2**20:.0f}M tokens per island "
        f"step: {rep['step_s']:.2f} s per step",
        f"data-parallel: {rep['dp_bytes_per_step'] / 1e9:.1f} GB per region per step each way; "
        f"one fragment (P = {a['fragments']}): {rep['fragment_bytes_up'] / 1e6:.0f} MB up "
        f"({a['up_codec']}), {rep['fragment_bytes_down'] / 1e6:.0f} MB down ({a['down_codec']})",
        f"merge throughput {a['merge_bytes_per_s'] / 1e9:.2f} GB/s ({a['merge_source']}); "
        f"encode {a['encode_bytes_per_s'] / 1e9:.2f} GB/s ({a['encode_source']})",
        "",
        "| Gbps | transfers | DP step s | sync step s | decoupled step s | island Gbps up/down "
        "| syncer Gbps in/out | syncer shards | vs DP | vs sync |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        lines.append(
            f"| {r['gbps']:g} | {'background' if r['overlap'] else 'in line'} "
            f"| {r['dp_step_s']:.1f} | {r['sync_step_s']:.2f} | {r['decoupled_step_s']:.2f} "
            f"| {r['island_gbps_up']:.2f} / {r['island_gbps_down']:.2f} "
            f"| {r['syncer_gbps_in']:.1f} / {r['syncer_gbps_out']:.1f} | {r['syncer_shards']} "
            f"| {r['speedup_vs_dp']:.1f}x | {r['speedup_vs_sync']:.2f}x |"
        )
    g = str(min(float(x) for x in rep["by_download"]))
    lines += [
        "",
        f"At {float(g):g} Gbps, by what the island downloads per fragment:",
        "",
        "| download | transfers | island Gbps down | vs DP | vs sync |",
        "|---|---|---|---|---|",
    ]
    for r in rep["by_download"][g]:
        lines.append(
            f"| {r['down_codec']} | {'background' if r['overlap'] else 'in line'} "
            f"| {r['island_gbps_down']:.2f} | {r['speedup_vs_dp']:.1f}x "
            f"| {r['speedup_vs_sync']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diloco bench wan --model-12b", description=__doc__)
    p.add_argument("--merge-json", default=None, help="`diloco bench merge --json` output")
    p.add_argument("--chip", choices=sorted(CHIPS), default=Assumptions.chip)
    p.add_argument("--mfu", type=float, default=Assumptions.mfu)
    p.add_argument("--chips-per-island", type=int, default=Assumptions.chips_per_island)
    p.add_argument("--regions", type=int, default=Assumptions.regions)
    p.add_argument("--down-codec", choices=sorted(CODEC_BYTES), default=Assumptions.down_codec)
    p.add_argument(
        "--downloads-per-round",
        type=int,
        default=Assumptions.downloads_per_round,
        help="updates an island downloads per fragment and round (quorum 1: up to --regions)",
    )
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    a = measured_assumptions(
        args.merge_json,
        chip=args.chip,
        mfu=args.mfu,
        chips_per_island=args.chips_per_island,
        regions=args.regions,
        down_codec=args.down_codec,
        downloads_per_round=args.downloads_per_round,
    )
    rep = report(a)
    print(format_report(rep))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(rep, indent=1))
    return 0
