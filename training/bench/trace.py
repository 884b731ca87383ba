"""Per-merge trace for the virtual-clock benches: what each outer step did to the global model.

`MergeTracer.after_merge(results, t)` is called by a bench after `Merger.merge_all()`; for every
version the merger published it records one row:
- `version`, `t` (virtual time), `islands_live` (what the bench says is running);
- `contributions`: per applied pseudo-gradient its island, fragment, seq, base version,
  staleness (versions), weight, norm, steps, tokens and mean inner loss (from the version's
  manifest and the pseudo-gradient manifests seen before the merge);
- `update_norm` = |Theta_v - Theta_{v-1}|, `params_norm` = |Theta_v|, `momentum_norm` = the norm
  of every floating leaf of the outer optimizer state (for Nesterov SGD: the momentum buffer);
- `eval_loss`, every `eval_every`-th version (None otherwise).
Benches add events (kills, restarts) with `event(kind, **fields)`; rows and events share one
time-ordered list, `records`. Everything is read from the store the merger wrote: the trace uses
only the public `ExperimentStore` API (manifest keys it does not find are left out).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from training.merge import replay
from training.store import merge_records as records


def global_norm(tree: dict[str, np.ndarray]) -> float:
    """The L2 norm of all of `tree`'s values together (float64 sums: a trace's figure)."""
    return float(np.sqrt(sum(float(np.vdot(v, v)) for v in tree.values())))


def state_norm(state: dict[str, np.ndarray]) -> float:
    """Norm of the floating leaves of a flattened optimizer state (counters are ignored)."""
    return global_norm({k: v for k, v in state.items() if np.issubdtype(v.dtype, np.floating)})


def diff_norm(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(math.sqrt(sum(float(np.sum((a[k] - b[k]) ** 2)) for k in a)))


class MergeTracer:
    def __init__(
        self,
        store,
        evaluate: Callable[[dict[str, np.ndarray]], float] | None = None,
        eval_every: int = 1,
        clock: Callable[[], float] = lambda: 0.0,
    ):
        self.store = store
        self.evaluate = evaluate
        self.eval_every = max(1, eval_every)
        self.clock = clock
        self.records: list[dict] = []
        self._pending: dict[str, dict] = {}
        self._prev: dict[int, tuple[int, dict[str, np.ndarray]]] = {}  # fragment -> version, params
        for head in store.heads():
            manifest = store.fragment_manifest(head)
            if records.params_sum(manifest) is None:
                params = store.load_fragment(head, manifest=manifest).params
            else:  # a light version without params: replayed
                params = replay.params_at(store.config(), store, head, manifest)
            self._prev[head.fragment] = (head.version, params)

    def before_merge(self) -> None:
        """Remember the manifests of the pending pseudo-gradients (steps, tokens, base)."""
        for ref in self.store.list_pseudograds(exclude=self._pending.keys()):
            self._pending[ref.id] = dict(ref.manifest)

    def event(self, kind: str, **fields) -> None:
        self.records.append(dict(kind=kind, t=self.clock(), **fields))

    def after_merge(self, results: Iterable, islands_live: Iterable[str] = ()) -> None:
        live = sorted(islands_live)
        for r in results:
            for fragment, version in sorted(getattr(r, "versions", {}).items()):
                self._record_version(fragment, version, live)

    def _record_version(self, fragment: int, version: int, live: list[str]) -> None:
        store = self.store
        head = store.head(fragment)
        ptr = head if head.version == version else store.find_version(fragment, version)
        manifest = store.fragment_manifest(ptr)
        cfg = None
        if records.light_ancestor(manifest) is None:
            g = store.load_fragment(ptr, outer_state=True, manifest=manifest)
            params, outer = g.params, g.outer_state
        else:  # a light version (syncer.full_every > 1): its state replayed, checked
            cfg = store.config()
            params, outer = replay.arrays_of(cfg, store)(ptr, manifest)
        contribs = []
        for c in manifest.get("contributions", []):
            pg = self._pending.pop(c.get("id"), {})
            contribs.append(
                dict(
                    id=c.get("id"),
                    island=c.get("island"),
                    fragment=c.get("fragment"),
                    staleness=c.get("staleness"),
                    weight=c.get("weight"),
                    norm=c.get("norm"),
                    loss=c.get("loss"),
                    base_version=pg.get("base_version"),
                    steps=pg.get("steps"),
                    tokens=pg.get("tokens"),
                    island_step=pg.get("island_step"),
                )
            )
        prev_version, prev_params = self._prev.get(fragment, (None, None))
        update = diff_norm(params, prev_params) if prev_version == version - 1 else None
        row = dict(
            kind="merge",
            t=self.clock(),
            fragment=fragment,
            version=version,
            islands_live=live,
            contributions=contribs,
            update_norm=update,
            params_norm=global_norm(params),
            momentum_norm=state_norm(outer),
            tokens_merged=manifest.get("tokens_merged"),
            eval_loss=None,
        )
        if self.evaluate is not None and version % self.eval_every == 0:
            cfg = cfg or store.config()
            row["eval_loss"] = float(
                self.evaluate(store.load_params(None, replay.params_of(cfg, store)))
            )
        self.records.append(row)
        self._prev[fragment] = (version, params)


def merges(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "merge"]


def format_trace(records: list[dict]) -> str:
    """One line per merge and per event, in time order (for logs and docs)."""
    lines = []
    for r in records:
        if r["kind"] != "merge":
            extra = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("kind", "t"))
            lines.append(f"{r['t']:8.0f}  ** {r['kind']} {extra}")
            continue
        parts = [
            f"{c['island'].removeprefix('island-')}:s{c['staleness']}"
            f"/w{c['weight']:.3g}/n{c['norm']:.3f}"
            for c in r["contributions"]
            if c.get("island") is not None
        ]
        loss = f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "-"
        upd = f"{r['update_norm']:.3f}" if r["update_norm"] is not None else "-"
        lines.append(
            f"{r['t']:8.0f}  v{r['version']:<4d} live={len(r['islands_live'])} "
            f"upd={upd} mom={r['momentum_norm']:.3f} eval={loss}  [{' '.join(parts)}]"
        )
    return "\n".join(lines)
