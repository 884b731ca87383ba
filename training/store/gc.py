"""Garbage collection of an experiment (docs/STORE.md, "Garbage collection").

`plan_gc` reads only and says what may go; `collect_garbage` deletes it and is safe to repeat.
Per fragment, a version is *protected* (keeps its payloads) when it is that fragment's HEAD, one
of the newest `keep_last` of its chain, version 0, the base an island's heartbeat or latest
checkpoint names, or part of the BEST or FINAL snapshot. A collected version keeps its manifest.json, so
every chain and every `applied` list stays readable.

A mixin of `ExperimentStore` (training/store/experiment.py), which supplies the I/O helpers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from training.store import merge_records as records
from training.store import safejson
from training.store.keys import FRAGMENT_DIR, PROMOTION, promoted_payload
from training.store.layout import (
    fragment_root,
    load_json,
    now,
    parse_pseudograd_id,
)
from training.store.objectstore import CorruptObject
from training.store.record_fields import is_int

_PAYLOAD_FILES = tuple(
    f"{n}.safetensors" for n in ("params", "outer_state", "update", "shadow")
) + tuple(  # versions.PAYLOADS + EXTRA_PAYLOADS, and a promotion's (training/store/promotions.py)
    promoted_payload(n) for n in ("params", "outer_state", "shadow")
)


@dataclass
class GCPlan:
    """What a garbage collection deletes.

    `versions`: committed fragment version directories whose payloads go (manifest stays);
    `orphan_dirs`: fragment directories off their HEAD's chain that can never be committed;
    `pseudograds`: merged pseudo-gradients (marker and payloads) applied outside the retention
    window of their fragment; `orphan_payloads`: pseudo-gradient payloads their marker does not
    name; `checkpoints`: checkpoint directories older than the island's LATEST.
    `heads` and `protected`: per fragment, its HEAD version and the versions kept.
    """

    keep_last: int = 0
    heads: dict[int, int] = field(default_factory=dict)
    protected: dict[int, list[int]] = field(default_factory=dict)
    versions: list[str] = field(default_factory=list)
    orphan_dirs: list[str] = field(default_factory=list)
    pseudograds: list[str] = field(default_factory=list)
    orphan_payloads: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (
            self.versions
            or self.orphan_dirs
            or self.pseudograds
            or self.orphan_payloads
            or self.checkpoints
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "keep_last": self.keep_last,
            "heads": {str(p): v for p, v in self.heads.items()},
            "protected": {str(p): v for p, v in self.protected.items()},
            "versions": self.versions,
            "orphan_dirs": self.orphan_dirs,
            "pseudograds": self.pseudograds,
            "orphan_payloads": self.orphan_payloads,
            "checkpoints": self.checkpoints,
        }


def _version_of(directory: str) -> tuple[int, int] | None:
    match = FRAGMENT_DIR.fullmatch(directory)
    return None if match is None else (int(match[1]), int(match[2]))


def _reanchored_bases(manifest: Mapping[str, Any]) -> set[int]:
    """The base versions a merge re-anchored stale votes at (outer.anchor = "now": it read
    their params; its `contributions` records say `reanchored` and `staleness`): version - 1 -
    staleness. Malformed records name nothing (the merge's replay reports them)."""
    version, found = manifest.get("version"), set()
    for r in manifest.get("contributions") or ():
        if isinstance(r, dict) and r.get("reanchored") is True and is_int(version):
            staleness = r.get("staleness")
            if is_int(staleness) and 0 <= staleness < version:
                found.add(version - 1 - staleness)
    return found


class GarbageCollection:
    """plan_gc / collect_garbage (mixed into ExperimentStore)."""

    def _chain(self, fragment: int) -> tuple[int | None, dict[int, str], bool, dict[str, int]]:
        """(head version, version -> directory along HEAD's chain, whether it reaches v0's root,
        pseudo-gradient id -> the version whose `applied` list names it: the truth the ledger
        is checked against). Also sets self._full_of[fragment]: light version -> the version
        of its full ancestor."""
        head = self.head(fragment)
        if not hasattr(self, "_full_of"):
            self._full_of: dict[int, dict[int, int]] = {}
        full_of = self._full_of
        full_of[fragment] = {}
        if head is None:
            return None, {}, True, {}
        dirs = {head.version: head.dir}
        complete = False
        applied_in: dict[str, int] = {}
        if not hasattr(self, "_bases_of"):
            self._bases_of: dict[int, dict[int, set[int]]] = {}
        bases_of = self._bases_of[fragment] = {}
        for manifest in self.list_fragment_versions(fragment):
            ancestor = records.light_ancestor(manifest)
            if ancestor is not None:
                full_of[fragment][manifest["version"]] = ancestor[0]
            bases = _reanchored_bases(manifest)
            if bases:
                bases_of[manifest["version"]] = bases
            parent, parent_dir = manifest.get("parent_version"), manifest.get("parent_dir")
            if parent_dir is None:
                complete = True
            elif is_int(parent) and isinstance(parent_dir, str):
                dirs[parent] = parent_dir
            listed, version = manifest.get("applied"), manifest.get("version")
            if isinstance(listed, list) and is_int(version):
                applied_in.update((i, version) for i in listed if isinstance(i, str))
        return head.version, dirs, complete, applied_in

    def _island_bases(self) -> list[Any]:
        """Every base version an island names (heartbeat and latest checkpoint): per-fragment
        lists, or one int for every fragment."""
        bases: list[Any] = [b.get("base_version") for b in self.heartbeats().values()]
        islands = [n.island for n in self.list_named("checkpoints/", "checkpoint-latest")]
        for island in islands:
            try:
                latest = self.checkpoint_pointer(island)
                if latest is not None:
                    bases.append(self.checkpoint_meta(island, latest).get("base_version"))
            except CorruptObject as exc:  # an island's own broken checkpoint protects nothing
                self.note_skipped(f"checkpoints/{island}/LATEST.json", exc)
        return bases

    def referenced_versions(
        self, keep_last: int = 1, keep_first: bool = True
    ) -> dict[int, set[int]]:
        """Per fragment, the versions that must keep their payloads (see the module docstring)."""
        bases = self._island_bases()
        named = []  # the versions of the snapshots BEST and FINAL name
        for record in (self.best() or {}, self.final() or {}):
            versions = record.get("versions")
            named.append(versions if isinstance(versions, list) else [])
        keep: dict[int, set[int]] = {}
        for p in range(self.num_fragments()):
            head, dirs, _, _ = self._chain(p)
            if head is None:
                continue
            kept = {head} | {v for v in dirs if v > head - max(1, keep_last)}
            if keep_first and 0 in dirs:
                kept.add(0)
            for base in bases:
                if is_int(base):
                    kept.add(base)
                elif isinstance(base, list) and p < len(base) and is_int(base[p]):
                    kept.add(base[p])
            for versions in named:
                if p < len(versions) and is_int(versions[p]):
                    kept.add(versions[p])
            keep[p] = kept | self._replayed(p, kept)
        return keep

    def _replayed(self, fragment: int, kept: set[int]) -> set[int]:
        """The versions a cold start, a restore or `diloco replay` of the kept light versions
        of `fragment` reads (docs/STORE.md, "Light versions"): from each one's full ancestor
        to it (the full one's state, each light one's params and update)."""
        full_of, bases_of = self._full_of.get(fragment, {}), self._bases_of.get(fragment, {})
        replayed = {u for v in kept if v in full_of for u in range(full_of[v], v + 1)}
        # under outer.anchor = "now" a replayed merge re-reads the params of the base versions
        # it re-anchored stale votes at, which may be older than the full ancestor
        return replayed | {b for u in replayed for b in bases_of.get(u, ())}

    def plan_gc(self, keep_last: int = 5, keep_first: bool = True) -> GCPlan:
        """What `collect_garbage` would delete now; reads only (see GCPlan)."""
        if not is_int(keep_last) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
        plan = GCPlan(keep_last=keep_last)
        protected = self.referenced_versions(keep_last, keep_first)
        plan.protected = {p: sorted(v) for p, v in protected.items()}
        # the merges a kept light version is replayed through keep their contributions: the
        # versions after its full ancestor, up to it
        replayed = {
            p: {u for v in kept for u in range(self._full_of[p].get(v, v) + 1, v + 1)}
            for p, kept in protected.items()
        }
        applied_in: dict[str, int] = {}  # what the versions' applied lists say (the truth)
        for p in range(self.num_fragments()):
            head, dirs, complete, chain_applied = self._chain(p)
            if head is None:
                continue
            applied_in.update(chain_applied)
            plan.heads[p] = head
            files: dict[str, set[str]] = {}
            for key in self.list_keys(f"{fragment_root(p)}/v"):
                directory, _, name = key.rpartition("/")
                files.setdefault(directory, set()).add(name)
            for version, directory in sorted(dirs.items()):
                if version not in protected[p] and files.get(directory, set()) & set(
                    _PAYLOAD_FILES
                ):
                    plan.versions.append(directory)
            on_chain = set(dirs.values())
            if complete:  # a broken chain (a manifest deleted by hand) hides what is committed
                for directory in sorted(files):
                    found = _version_of(directory)
                    if found and directory not in on_chain and found[1] <= head:
                        plan.orphan_dirs.append(directory)

        quarantined = set(self.quarantined())
        markers: set[str] = set()
        payload_keys: dict[str, list[str]] = {}
        for key in self.list_keys("pseudograds/"):
            name = self.parse_listed(key)
            if name is not None and name.kind == "pseudograd-marker":
                markers.add(name.id)
            elif name is not None and name.kind == "pseudograd-payload":
                payload_keys.setdefault(name.id, []).append(key)
        # the ledger entries of the pseudo-gradients still in the store only (a run's whole
        # history would be read on every collection otherwise)
        # A pseudo-gradient goes only once a version's applied list names it (the ledger entry
        # must exist too: delete_pseudograd checks it); an entry the versions contradict (a
        # forged one, for a contribution still pending) is reported and protects it.
        applied = self.applied(markers | set(payload_keys))
        for pg_id in sorted(markers | set(payload_keys)):
            ledger, version = applied.get(pg_id), applied_in.get(pg_id)
            if ledger is not None and ledger >= 0 and ledger != version:
                said = "no version" if version is None else f"version {version}"
                self.note_skipped(
                    f"ledger/{pg_id}.json",
                    f"contradicts the versions: it names version {ledger}, {said} applied it; "
                    "not collected",
                )
            fragment = parse_pseudograd_id(pg_id)[2]
            head = plan.heads.get(fragment)
            window_start = None if head is None else head - keep_last + 1
            stale = (
                ledger is not None
                and version is not None
                and window_start is not None
                and version < window_start
                and version not in replayed.get(fragment, ())
            )
            if stale and pg_id not in quarantined:
                plan.pseudograds.append(pg_id)
        collected = set(plan.pseudograds)
        several = [i for i in sorted(markers - collected) if len(payload_keys.get(i, [])) > 1]
        got = self.read_records(
            [f"pseudograds/{i}.json" for i in several],
            safejson.MANIFEST.max_bytes,
            lambda data, relative: load_json(data, relative, safejson.MANIFEST),
        )
        for relative, marker in got:
            pg_id = relative.removeprefix("pseudograds/").removesuffix(".json")
            named = marker.get("payload")
            if isinstance(named, str):
                plan.orphan_payloads += [k for k in payload_keys[pg_id] if k != named]

        ckpt_dirs: dict[str, dict[str, int]] = {}
        for name in self.list_named("checkpoints/", "checkpoint-file"):
            ckpt_dirs.setdefault(name.island, {})[name.dir] = name.step
        for island, directories in sorted(ckpt_dirs.items()):
            try:
                latest = self.checkpoint_pointer(island)
            except CorruptObject as exc:
                self.note_skipped(f"checkpoints/{island}/LATEST.json", exc)
                continue
            if latest is None:
                continue  # no committed checkpoint: everything may still be in flight
            for directory, step in sorted(directories.items()):
                if step < latest.step:
                    plan.checkpoints.append(directory)
        return plan

    def delete_prefix(self, relative_prefix: str) -> int:
        """Delete every object under `relative_prefix` (in parallel); the number listed. A
        directory prefix (ending in '/': a checkpoint's, a version's, names never used again)
        is then removed from stores that have directories (`remove_empty_dir`)."""
        keys = self.list_keys(relative_prefix)
        self.parallel(lambda k: self.store.delete(self.object_key(k)), keys)
        if relative_prefix.endswith("/"):
            self.store.remove_empty_dir(self.object_key(relative_prefix))
        return len(keys)

    def _collect_version(self, directory: str) -> bool:
        names = [f"{directory}/{n}" for n in _PAYLOAD_FILES]
        present = [n for n in names if self.store.exists(self.object_key(n))]
        if not present:
            return False
        self.write_json(f"{directory}/{self.COLLECTED}", {"at": now()})
        self.store.delete(self.object_key(f"{directory}/{PROMOTION}"))  # before its payloads
        for name in present:
            self.store.delete(self.object_key(name))
        return True

    def delete_pseudograd(self, pg) -> int:
        """Delete a merged pseudo-gradient: its marker first, then every payload of its id.

        Refuses (ValueError) one without a ledger entry (not merged). Its ledger entry stays, so
        the id stays applied. Returns the number of objects deleted.
        """
        pg_id = pg if isinstance(pg, str) else pg.id
        parse_pseudograd_id(pg_id)
        if not self.store.exists(self.object_key(f"ledger/{pg_id}.json")):
            raise ValueError(f"{self.url}: pseudo-gradient {pg_id} is not merged; not deleted")
        marker = self.object_key(f"pseudograds/{pg_id}.json")
        deleted = int(self.store.exists(marker))
        self.store.delete(marker)
        return deleted + self.delete_prefix(f"pseudograds/{pg_id}-")

    def collect_garbage(self, plan: GCPlan) -> dict[str, int]:
        """Delete what `plan` (from `plan_gc`) lists; safe to repeat. Counts of what went."""
        counts = dict.fromkeys(
            ("versions", "orphan_dirs", "pseudograds", "orphan_payloads", "checkpoints"), 0
        )
        protected = self.referenced_versions(plan.keep_last or 1)
        for directory in plan.versions:
            found = _version_of(directory)
            if found is None or found[1] in protected.get(found[0], {found[1]}):
                continue
            counts["versions"] += int(self._collect_version(directory))
        for directory in plan.orphan_dirs:
            counts["orphan_dirs"] += int(self.delete_prefix(f"{directory}/") > 0)
        for pg_id in plan.pseudograds:
            counts["pseudograds"] += int(self.delete_pseudograd(pg_id) > 0)
        for key in plan.orphan_payloads:
            self.store.delete(self.object_key(key))
            counts["orphan_payloads"] += 1
        for directory in plan.checkpoints:
            counts["checkpoints"] += int(self.delete_prefix(f"{directory}/") > 0)
        return counts
