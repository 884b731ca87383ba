"""The outer optimizer on host arrays: its per-fragment state (`OuterFragmentState`, made by
`init_state`, stored as named tensors by `state_tensors` / `state_from_tensors`), its learning
rate (`outer_lr`) and its step (`outer_step_`), applied in place chunk by chunk, or in one pass
of training/codecs/native.c's loop where it loaded (the same bits). Pure functions, no store.

`tests/test_merge_rules.py` checks the step against the optax transforms of
tests/reference_outer.py (`optax.sgd(..., nesterov=True)`, `delayed_nesterov`). Sign convention:
deltas are pseudo-gradients (global minus local, training/protocol/pseudograd.py); the outer step
moves the parameters against them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from training.codecs import host as codecs
from training.codecs import kernels, native
from training.config.experiment import OuterConfig
from training.merge import stream as merge_stream


class OuterFragmentState(NamedTuple):
    """All outer-optimizer state of one fragment (serialized: training/merge/merger.py)."""

    steps: int  # outer steps applied
    seen: int  # contributions seen (Delayed Nesterov's counter)
    momentum: dict[str, np.ndarray]  # per tensor; empty when momentum = 0
    buffer: dict[str, np.ndarray]  # Delayed Nesterov's D; empty for other methods


def _state_kinds(outer: OuterConfig) -> list[str]:
    """The per-tensor state a method keeps: momentum (if any), Delayed Nesterov's buffer."""
    kinds = ["momentum"] if outer.momentum else []
    return kinds + (["buffer"] if outer.method == "delayed_nesterov" and outer.momentum else [])


def init_state(outer: OuterConfig, shapes: Mapping[str, tuple[int, ...]]) -> OuterFragmentState:
    kinds = _state_kinds(outer)
    zeros = {k: {n: np.zeros(s, np.float32) for n, s in shapes.items()} for k in kinds}
    return OuterFragmentState(0, 0, zeros.get("momentum", {}), zeros.get("buffer", {}))


def outer_lr(outer: OuterConfig, steps: int) -> float:
    """The outer learning rate of a fragment's outer step number `steps` + 1: `outer.lr`, ramped
    linearly over the first `outer.lr_warmup` steps (lr / W, 2 lr / W, ..., lr)."""
    if outer.lr_warmup <= 0:
        return outer.lr
    return outer.lr * min(1.0, (steps + 1) / outer.lr_warmup)


def _outer_step_c(lib, n: int, arrays, factors: np.ndarray, flags, scalars) -> list[float]:
    """native.c `outer_step_sq` on one tensor (params, g, momentum or None, buffer or None),
    threads over chunks (native.over_chunks: the same bits); returns the new params'
    per-chunk sums of squares."""
    step = codecs.chunk_step()
    sums = np.empty(-(-n // step), np.float64)
    bases = [native.address(a) for a in arrays]

    def run(s: int, e: int, k0: int) -> None:
        at = [None if a is None else a + 4 * s for a in bases]
        fixed = (factors.ctypes.data, factors.size, *flags, *scalars)
        lib.outer_step_sq(e - s, *at, *fixed, step, sums.ctypes.data + 8 * k0)

    native.over_chunks(n, step, run)
    return sums.tolist()


def _fused_c(
    lib, n: int, arrays, folded, factors: np.ndarray, flags, scalars, fused, encode, name: str
) -> list[float]:
    """One C pass over one tensor, threads over chunks: the outer step with the broadcast
    update's encode fused in block by block (`fused`: codecs.PendingStep's outputs; native.c
    `outer_encode_sq`), the update read from `arrays[1]`; or, with `folded` (a kernels.Folded:
    the votes, never written out), folded stretch by stretch in L1 first (`fold_outer_encode_sq`,
    the encode when `fused` is given). Returns the new params' per-chunk sums of squares. A
    range whose encode the C loop refused at a block is finished here: the blocks after it
    stepped by the same loop without the encode, the sums of its chunk and those after, then
    the encode from that block on (PendingStep.rest: numpy where C refuses). The bits of the
    fold, then the outer step, then the encode."""
    step = codecs.chunk_step()
    sums = np.empty(-(-n // step), np.float64)
    p, g, m, d = (native.address(a) for a in arrays)
    fixed = (factors.ctypes.data, factors.size, *flags, *scalars)
    nothing = (0, 0.0, codecs.DEFAULT_BLOCK, None, None, None)  # no encode
    stopped: list[tuple[int, int]] = []  # (the refused block's start, its range's end)

    def at(s: int, arrays):
        return [None if a is None else a + 4 * s for a in arrays]

    def coded(s: int):
        if fused is None:
            return nothing
        base, data, scales = (native.address(a) for a in (fused.base, fused.data, fused.scales))
        where = (base + 4 * s, data + s // fused.per, scales + 4 * (s // fused.block))
        return (fused.kind, fused.levels, fused.block, *where)

    def step_from(s: int, e: int, out: int, encoded) -> int:
        """The C pass over [s, e) (sums into `out`): the elements done."""
        if folded is not None:
            votes = (*folded.pointers(), folded.block)
            return lib.fold_outer_encode_sq(
                e - s, s, *votes, *at(s, (p, m, d)), *fixed, step, out, *encoded
            )
        if encoded is nothing:
            lib.outer_step(e - s, *at(s, (p, g, m, d)), *fixed)
            return e - s
        return lib.outer_encode_sq(e - s, *at(s, (p, g, m, d)), *fixed, step, out, *encoded)

    def run(s: int, e: int, k0: int) -> None:
        done = step_from(s, e, sums.ctypes.data + 8 * k0, coded(s))
        if s + done < e:
            stopped.append((s + done, e))

    native.over_chunks(n, step, run)
    flat = arrays[0].reshape(-1)
    for s, e in sorted(stopped):
        after = min(e, s + fused.block)
        if after < e:  # the blocks after the refused one, stepped without the encode
            spare = np.empty(-(-(e - after) // step), np.float64)  # sums of shifted chunks
            step_from(after, e, spare.ctypes.data, nothing)
        first = s // step  # its chunk's sum and those after, as outer_step_sq takes them
        sums[first : -(-e // step)] = native.chunk_sumsq(flat[first * step : e], step)
        encode.rest(name, arrays[0], s, e)
    return sums.tolist()


def outer_step_(
    outer: OuterConfig,
    period: int,
    params: dict[str, np.ndarray],
    state: OuterFragmentState,
    delta: dict[str, np.ndarray],
    final: bool = False,
    gains: Mapping[str, Sequence[np.float32]] | None = None,
    share: float = 1.0,
    params_sq: dict[str, list[float]] | None = None,
    encode: codecs.PendingStep | None = None,
) -> OuterFragmentState:
    """theta <- outer step(theta, delta), in place on `params` and the state's arrays.

    - momentum 0: theta -= lr * g;
    - SGD with momentum (Nesterov or not), as optax.sgd: m <- beta m + g; theta -= lr (g + beta
      m) with Nesterov, lr m without;
    - Delayed Nesterov with period N (arXiv 2401.09135): D += g; on every N-th contribution
      m <- beta m + D / N, theta -= lr (g / N + beta m), D <- 0; otherwise theta -= lr g / N.
    lr is `outer_lr` of the state's step count. `final` (an island's last, partial interval):
    theta -= lr g and the state does not move, so a few steps' remainder never buys a full
    momentum step (the end-of-run degradation).
    `share` < 1 with `outer.fractional_momentum` (a merge of n of M islands, share n/M): the
    step is that fraction of an outer step for the momentum as well: m <- beta^share m + g;
    Nesterov theta -= lr (g + share beta m), else theta -= lr (share m + (1 - share) g). At
    share 1 both are the plain rule; two half-merges of g/2 come out near one full merge of g
    (where each would otherwise re-apply beta m whole). numpy only (no C loop for it yet).
    g = delta[n] multiplied in turn by each factor of `gains[n]` (Combiner.finish). Applied
    chunk by chunk (codecs.chunk_spans), so its temporaries stay in cache, or in one pass of
    training/codecs/native.c's loop where it loaded (the same bits). `delta` may be overwritten.
    `params_sq` (a dict, filled): per tensor, the float64 sums of squares of the new params'
    chunks, taken while each chunk is in cache (merge_stream.sq_total: the next merge's
    params norm without a pass).
    `encode` (a codecs.PendingStep of the broadcast update against the shadow): where the C
    loop takes a tensor, its update is encoded chunk by chunk as its new params are written
    (native.c `outer_encode_sq`: one pass instead of two, the same bits); `encode.payload`
    makes the rest after.
    """
    lr, beta = np.float32(outer_lr(outer, state.steps)), np.float32(outer.momentum)
    plain = final or not outer.momentum
    delayed = outer.method == "delayed_nesterov" and not plain
    seen = state.seen + 1
    flush = delayed and seen % period == 0
    inv = np.float32(1.0 / period)
    mode = 0 if plain else (2 if delayed else 1)
    frac = mode == 1 and outer.fractional_momentum and share < 1.0
    decay = np.float32(outer.momentum**share) if frac else beta
    look = np.float32(outer.momentum * share) if frac else beta
    keep = np.float32(share) if frac else np.float32(1.0)
    for n, g_all in delta.items():
        factors = np.asarray((gains or {}).get(n, ()), np.float32)
        folded = g_all if isinstance(g_all, kernels.Folded) else None
        arrays = [
            params[n],
            None if folded is not None else g_all,
            state.momentum[n] if mode else None,
            state.buffer[n] if delayed else None,
        ]
        lib = native.library() if not frac and native.fits_float32(*arrays) else None
        if lib is not None and folded is not None:  # the votes folded in the same pass
            flags = (mode, int(outer.nesterov), int(flush))
            fused = None if encode is None else encode.fused(n, params[n])
            sums = _fused_c(
                lib, folded.size, arrays, folded, factors, flags, (lr, beta, inv), fused, encode, n
            )
            if fused is not None:
                encode.done(n)
            if params_sq is not None:
                params_sq[n] = sums
            continue
        if folded is not None:  # a step the C loop does not take: the accumulator made
            g_all = folded.dense().reshape(params[n].shape)
            arrays[1] = g_all
        if lib is not None:  # one C pass, the numpy loop below bit for bit
            flags = (mode, int(outer.nesterov), int(flush))
            fused = None if encode is None else encode.fused(n, params[n])
            if fused is not None:
                sums = _fused_c(
                    lib, g_all.size, arrays, None, factors, flags, (lr, beta, inv), fused, encode, n
                )
                encode.done(n)
            else:
                sums = _outer_step_c(lib, g_all.size, arrays, factors, flags, (lr, beta, inv))
            if params_sq is not None:
                params_sq[n] = sums
            continue
        flat = {"p": params[n].reshape(-1), "g": g_all.reshape(-1)}
        if not plain:
            flat["m"] = state.momentum[n].reshape(-1)
        if delayed:
            flat["d"] = state.buffer[n].reshape(-1)
        for s, e in codecs.chunk_spans(flat["g"].size):
            c = {k: v[s:e] for k, v in flat.items()}
            g = c["g"]
            for factor in (gains or {}).get(n, ()):
                g *= factor
            if plain:
                c["p"] -= lr * g
            elif delayed:
                d, m = c["d"], c["m"]
                d += g
                g *= inv
                if flush:
                    m *= beta
                    m += inv * d
                    d[...] = 0
                    g += beta * m
                c["p"] -= lr * g
            else:
                m = c["m"]
                m *= decay
                m += g
                if outer.nesterov:
                    g += look * m
                    c["p"] -= lr * g
                elif frac:
                    c["p"] -= lr * (keep * m + (np.float32(1.0) - keep) * g)
                else:
                    c["p"] -= lr * m
            if params_sq is not None:
                params_sq.setdefault(n, []).append(merge_stream.sq(c["p"]))
    if final:
        return state
    return state._replace(steps=state.steps + 1, seen=seen)


def state_tensors(state: OuterFragmentState) -> dict[str, np.ndarray]:
    """The state's arrays as named tensors ("momentum/<name>", "buffer/<name>")."""
    out = {f"momentum/{n}": v for n, v in state.momentum.items()}
    out.update({f"buffer/{n}": v for n, v in state.buffer.items()})
    return out


def state_from_tensors(
    outer: OuterConfig,
    shapes: Mapping[str, tuple[int, ...]],
    tensors: Mapping[str, np.ndarray],
    steps: int,
    seen: int,
) -> OuterFragmentState:
    """Rebuild a fragment's state; ValueError naming the first tensor that does not fit."""
    # the names and shapes init_state would make (without making its zeros)
    expected = {f"{k}/{n}": tuple(s) for k in _state_kinds(outer) for n, s in shapes.items()}
    if sorted(tensors) != sorted(expected):
        raise ValueError(f"outer state tensors {sorted(tensors)[:4]} != {sorted(expected)[:4]}")
    for k, v in tensors.items():
        if v.dtype != np.float32 or v.shape != expected[k]:
            raise ValueError(f"outer state {k}: {v.dtype} {v.shape}, expected {expected[k]}")
    pick = {
        kind: {n[len(kind) + 1 :]: v for n, v in tensors.items() if n.startswith(kind + "/")}
        for kind in ("momentum", "buffer")
    }
    return OuterFragmentState(steps, seen, pick["momentum"], pick["buffer"])
