"""`diloco`: a thin command line over the library (past 500 lines: one short handler and
its argument parser per subcommand, kept together so each command reads in one place).

    diloco init    --store URL --name NAME [--config FILE] [--set key=value ...]   (create or join)
    diloco island  --store URL --experiment NAME --island NAME
                   [--coordinator HOST:PORT --num-processes N --process-id I]
    diloco merge   --store URL --experiment NAME [--follow]
    diloco eval    --store URL --experiment NAME [--version N] [--record]
    diloco export  --store URL --experiment NAME --out DIR [--snapshot head|best|final|N]
                   [--format safetensors|orbax|hf] [--overwrite]
    diloco sample  --store URL --experiment NAME --prompt TEXT [--snapshot head|best|final|N]
    diloco sample  --from DIR --prompt TEXT (an export directory)
                   [--max-tokens N --temperature T --top-k K --seed S]
    diloco status  --store URL --experiment NAME [--json]
    diloco stop    --store URL --experiment NAME [--island NAME]
    diloco delete  --store URL --experiment NAME [--yes]   (not while its islands run)
    diloco list    --store URL [--json]
    diloco history --store URL --experiment NAME [--json]
    diloco report  --store URL --experiment NAME --out DIR
    diloco prepare --data SRC --tokenizer T --out URL [--workers N] [--text-field F]
    diloco bench   quality | goodput-sim | chaos | merge | fetch | wan | science | island | scavenge
                   | stream | device | syncer  [...]

Every error a user can cause (a bad config, name or URL, an unreachable store, a corrupt object)
ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from training.config.experiment import (
    ConfigError,
    ExperimentConfig,
    load_config,
    parse_config,
    parse_sets,
    with_overrides,
)
from training.island.multihost import flag_defaults

log = logging.getLogger("diloco")


def _open(store_url: str, experiment: str, faults=None):
    """The experiment's store; `faults`: the process's fault plan (`diloco island` and `diloco
    merge` hand over `FaultPlan.from_env()`, training/faults/points.py)."""
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store

    store = open_store(store_url)
    store.check()
    return ExperimentStore(store, experiment, faults=faults)


def _load(args, faults=None) -> tuple[ExperimentConfig, object]:
    estore = _open(args.store, args.experiment, faults)
    return estore.config(), estore


def _config_fields_help() -> str:
    """The config's fields with their descriptions, for `diloco init --help`."""
    from training.config.experiment import field_docs

    lines = ["config fields (--set FIELD=VALUE; JSON values, else strings):"]
    lines += [f"  {name:32s} {doc}" for name, doc in field_docs().items()]
    return "\n".join(lines)


def cmd_init(args) -> int:
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store
    from training.usecases.create import create_or_join

    # --name and --store win over the file's (which need not have them)
    names = {"name": args.name, "store_url": args.store}
    cfg = load_config(args.config, **names) if args.config else parse_config(names)
    cfg = with_overrides(cfg, parse_sets(args.set or []))
    # the checks (budget, model, store) come first, in create_or_join: nothing half-written
    result = create_or_join(cfg, ExperimentStore(open_store(cfg.store_url), cfg.name))
    state = "created version 0" if result.created_version0 else "already initialized"
    print(f"experiment {cfg.name} in {cfg.store_url}: {state}")
    # (a stop marker on the experiment is create_or_join's logged warning)
    if not result.created and result.new_islands:
        print(f"joined islands {', '.join(result.new_islands)}")
    if result.initial_loss is not None:
        print(f"initial eval loss {result.initial_loss:.4f}")
    return 0


def cmd_island(args) -> int:
    from training.island import multihost

    # before anything touches a device: a multi-host island is one jax.distributed job
    group = multihost.initialize(args.coordinator, args.num_processes, args.process_id)
    from training.faults.chaos import IslandChaos, for_process
    from training.faults.points import FaultPlan
    from training.island.process import Island

    faults = FaultPlan.from_env()  # one plan: the island's step and its store's points
    cfg, estore = _load(args, faults)
    estore = for_process(cfg, estore, "island")
    # chaos mode's slow-down and stall are process 0's (it alone heartbeats)
    chaos = IslandChaos.for_island(cfg, args.island, estore) if group.writer else None
    island = Island(
        cfg,
        args.island,
        estore,
        background=True,
        faults=faults,
        group=group,
        chaos=chaos,
    )
    info = island.run(max_steps=args.max_steps)
    print(json.dumps(info), flush=True)
    multihost.finish(group)  # process 0 of several leaves here (os._exit: see its docstring)
    return 0


def cmd_merge(args) -> int:
    from training.faults.chaos import for_process
    from training.faults.points import FaultPlan
    from training.merge.merger import Merger

    cfg, estore = _load(args, FaultPlan.from_env())
    estore = for_process(cfg, estore, "merge")  # the merger hits its store's fault plan
    merger = Merger(
        cfg, estore
    )  # kept warm across passes, as the syncer's (training/merge/syncer.py)
    stop = threading.Event()  # SIGTERM: end after the pass in progress
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    while True:
        # read the exit condition before merging: a pass that starts after it held sees every
        # pseudo-gradient the (done) islands committed. Every island done is the end, STOP or
        # not (the merges of that last pass write it when they reach the budget): a run whose
        # islands ended short of it (their own token limits, a contribution quarantined) ends
        # too, as the syncer's does (training/merge/syncer.py `is_finished`)
        finishing = args.follow and _all_done(cfg, estore)
        for r in merger.merge_all():
            if r.version is not None:
                print(f"version {r.version}: applied {len(r.applied)}", flush=True)
            for pg, why in r.quarantined.items():
                print(f"quarantined {pg}: {why}", flush=True)
        if not args.follow or finishing or stop.is_set():
            # this process's memory goes: its light HEADs are promoted (the next start begins
            # there instead of replaying the merges since their full versions)
            promoted = merger.promote_heads()
            if promoted:
                print(f"promoted the light HEADs of fragments {promoted}", flush=True)
            return 0
        stop.wait(args.poll)
        latest = estore.config()
        if latest != cfg:  # islands joined: a new merger sees them
            cfg, merger = latest, Merger(latest, estore)


def _all_done(cfg: ExperimentConfig, estore) -> bool:
    return set(estore.done()) >= {i.name for i in cfg.islands}


def cmd_eval(args) -> int:
    from training.merge import replay
    from training.model.evaluate import evaluate_snapshot
    from training.views.progress import Progress

    with Progress("eval", total=2) as bar:
        bar.step("reading the snapshot")
        cfg, estore = _load(args)
        snapshot = None if args.version is None else _at_version(cfg, estore, args.version)
        bar.step(f"evaluating {cfg.data.eval_batches} batches")
        out = evaluate_snapshot(
            cfg, estore, snapshot, record=args.record, params_of=replay.params_of(cfg, estore)
        )
    print(json.dumps(out))
    return 0


def _at_version(cfg, estore, n: int):
    """The snapshot of every fragment at its committed version `n`."""
    count = cfg.fragments.count
    dirs = [estore.find_version(p, n).dir for p in range(count)]
    return estore.snapshot_of({"versions": [n] * count, "dirs": dirs})


def _shapes(params) -> dict:
    """{name: (shape, dtype)} of loaded parameters (export.check_model's argument)."""
    return {n: (v.shape, v.dtype) for n, v in params.items()}


def _pick_snapshot(cfg, estore, which: str):
    """The snapshot `--snapshot` names: None for `head` (every fragment's HEAD, read as one
    consistent snapshot), BEST's recorded snapshot, FINAL's (the model a finished run ends
    with), or every fragment at version N."""
    from training.config.experiment import ConfigError

    if which == "head":
        return None
    if which == "best":
        record = estore.best()
        if record is None:
            raise ConfigError("--snapshot best: no evaluated snapshot recorded yet")
        return estore.on_chain(estore.snapshot_of(record))
    if which == "final":
        record = estore.final()
        if record is None:
            raise ConfigError("--snapshot final: the run has not ended (no snapshots/FINAL.json)")
        return estore.on_chain(estore.snapshot_of(record))
    if which.isdigit():
        return _at_version(cfg, estore, int(which))
    raise ConfigError(f"--snapshot {which!r}: use head, best, final or a version number")


def cmd_export(args) -> int:
    """The snapshot as one safetensors file plus config.json (sizes, family, tokenizer), the
    tokenizer's file and export.json (training/model/export.py `export_to`)."""
    import pathlib

    from training.data.tokenizer import tokenizer_for
    from training.merge import replay
    from training.model.export import check_model, check_out, export_to

    out = pathlib.Path(args.out)
    check_out(out, args.overwrite)  # before anything is read
    cfg, estore = _load(args)
    snapshot = _pick_snapshot(cfg, estore, args.snapshot) or estore.current_snapshot()
    params = estore.load_params(snapshot, replay.params_of(cfg, estore))
    # the model section config.json describes, bounded and held to the tensors read: an
    # export's config.json never claims a model its weights are not
    check_model(cfg.model, _shapes(params), f"{estore.url}/config.json")
    record = {"best": estore.best, "final": estore.final}.get(args.snapshot, lambda: None)()
    what = {"snapshot": args.snapshot, "experiment": args.experiment}
    export_to(out, cfg, params, tokenizer_for(cfg), what, args.format, estore.url, snapshot, record)
    line = {"out": str(out), "tensors": len(params)}
    print(json.dumps({**line, "format": "hf"} if args.format == "hf" else line))
    return 0


def cmd_sample(args) -> int:
    """A continuation of --prompt from a snapshot (HEADs `head`, BEST `best`, FINAL `final` or
    every fragment at version N) or from an export directory (`--from DIR`); encoded and
    decoded with the experiment's tokenizer (the one the directory holds)."""
    from training.data.tokenizer import tokenizer_for
    from training.merge import replay
    from training.model.export import check_model
    from training.model.sample import sample

    if args.from_dir:
        from training.model.export import load_export

        mcfg, params, tok = load_export(args.from_dir)
    elif not (args.store and args.experiment):
        raise ConfigError("sample: give --store and --experiment, or --from DIR")
    else:
        cfg, estore = _load(args)
        snapshot = _pick_snapshot(cfg, estore, args.snapshot) or estore.current_snapshot()
        params = estore.load_params(snapshot, replay.params_of(cfg, estore))
        check_model(cfg.model, _shapes(params), f"{estore.url}/config.json")  # before a build
        mcfg, tok = cfg.model, tokenizer_for(cfg)
        if snapshot is not None and snapshot.tokens_merged == 0:
            print(
                f"note: {args.experiment} has merged no training yet: this samples the "
                "untrained (random) model of version 0",
                file=sys.stderr,
            )
    ids = sample(
        mcfg, params, tok.encode(args.prompt), args.max_tokens,
        args.temperature, args.top_k, args.seed,
    )  # fmt: skip
    print(args.prompt + tok.decode(ids))
    return 0


def cmd_status(args) -> int:
    from training.views.status import collect_status, format_status

    cfg, estore = _load(args)
    status = collect_status(cfg, estore)
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


def cmd_stop(args) -> int:
    estore = _open(args.store, args.experiment)
    estore.request_stop(args.island)
    print(f"stop requested for {args.island or 'all islands'} of {args.experiment}")
    return 0


def running_islands(cfg, estore, now: float) -> list[str]:
    """The islands of `cfg` that may still run: no done marker and a heartbeat that the stall
    rule (training/protocol/stall.py `wait_timeout_s`: what Airflow waits before it calls an
    island stalled) does not call too old at `now`."""
    from training.protocol import stall

    done, beats = set(estore.done()), estore.heartbeats()
    limit = stall.wait_timeout_s(cfg.heartbeat_s)
    return sorted(
        i.name
        for i in cfg.islands
        if i.name not in done
        and isinstance((beats.get(i.name) or {}).get("at"), int | float)
        and not stall.beat_too_old(beats[i.name]["at"], now, limit)
    )


def cmd_delete(args) -> int:
    """Delete an experiment: every object under its prefix. Refused while its islands run;
    asks for the experiment's name on a terminal, or takes --yes."""
    import time

    cfg, estore = _load(args)
    alive = running_islands(cfg, estore, time.time())
    if alive:
        raise ConfigError(
            f"delete {args.experiment}: islands {alive} are running (their heartbeats are not "
            "stale yet): stop them first (diloco stop) and wait for them to end"
        )
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"delete {args.experiment}: pass --yes to delete without a prompt")
        typed = input(f"delete {estore.url} and everything in it? type its name to confirm: ")
        if typed.strip() != args.experiment:
            print("not deleted")
            return 1
    count = estore.delete_prefix("")
    print(f"deleted {args.experiment}: {count} objects")
    return 0


def cmd_list(args) -> int:
    from training.store.registry import open_store
    from training.views.report import format_list, list_rows

    store = open_store(args.store)
    store.check()
    rows = list_rows(store)
    print(json.dumps(rows, indent=1) if args.json else format_list(rows))
    return 0


def cmd_history(args) -> int:
    from training.views.report import format_history, history

    cfg, estore = _load(args)
    h = history(cfg, estore)
    print(json.dumps(h, indent=1) if args.json else format_history(h))
    return 0


def cmd_replay(args) -> int:
    from training.merge import replay

    cfg, estore = _load(args)
    return replay.run(cfg, estore, args.fragment, args.to, args.start, args.keep_going, emit=print)


def cmd_report(args) -> int:
    from training.views.dashboard import experiment_view
    from training.views.progress import Progress
    from training.views.report import write_report

    with Progress("report", total=2) as bar:
        bar.step("reading the store")
        cfg, estore = _load(args)
        view = experiment_view(cfg, estore)
        baselines = estore.read_metrics("baseline")
        bar.step("drawing the charts")
        written = write_report(view, args.out, baselines[-1] if baselines else None)
    print(f"wrote {', '.join(written['charts'])} and {written['html']}")
    return 0


def cmd_prepare(args) -> int:
    from tqdm import tqdm

    from training.data.prepare import prepare
    from training.faults.points import FaultPlan

    with tqdm(desc="prepare", unit=" shard", disable=None) as bar:

        def progress(record: dict, summary) -> None:
            bar.total = summary.units - summary.skipped
            bar.set_postfix(tokens=f"{summary.new_tokens:,}", refresh=False)
            bar.update(1)

        summary = prepare(
            args.data,
            args.tokenizer,
            args.out,
            workers=args.workers,
            text_field=args.text_field,
            chunk_bytes=args.chunk_mb << 20,
            progress=progress,
            faults=FaultPlan.from_env(),
        )
    print(f"prepared {args.out}: {summary.line()}")
    for example in summary.examples[:10]:
        print(f"  bad input: {example}")
    return 0


def cmd_bench(args, rest: list[str]) -> int:
    """`diloco bench NAME ...`: the benchmark's own `main` (training/bench/, BENCHES)."""
    import importlib

    if args.bench not in BENCHES:
        raise ConfigError(f"unknown benchmark {args.bench!r}")
    return importlib.import_module(BENCHES[args.bench]).main(rest)


def _int_at_least(what: str, low: int):
    """An argparse type: an int >= `low`, or a one-line usage error naming `what`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a {what} >= {low}, got {value}")
        return value

    return parse


_count = _int_at_least("process count", 1)


def _index(text: str) -> int | None:
    """A process index; empty: unknown (left to jax.distributed to detect)."""
    return None if text == "" else _int_at_least("process index", 0)(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco", description="Decoupled DiLoCo training pipeline")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    def with_store(sp, experiment=True):
        sp.add_argument(
            "--store", required=True, help="file:///path, gs://bucket/prefix, memory://x"
        )
        if experiment:
            sp.add_argument("--experiment", required=True)
        return sp

    sp = with_store(
        sub.add_parser(
            "init",
            help="create an experiment, or join its islands to it if it exists",
            epilog=_config_fields_help(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        ),
        experiment=False,
    )
    sp.add_argument("--name", required=True)
    sp.add_argument(
        "--config", help="JSON config file (fields of training.config.experiment.ExperimentConfig)"
    )
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="e.g. outer.lr=0.5")
    sp.set_defaults(fn=cmd_init)

    sp = with_store(sub.add_parser("island", help="run one island until stopped"))
    sp.add_argument("--island", required=True)
    sp.add_argument("--max-steps", type=int, default=None)
    defaults = flag_defaults()
    multi = sp.add_argument_group(
        "multi-host islands (one process per host; training/island/multihost.py)",
        "defaults from DILOCO_COORDINATOR, DILOCO_NUM_PROCESSES and DILOCO_PROCESS_ID, which "
        "the tpu_vm and gke backends set; an empty coordinator or process id is detected by "
        "jax.distributed (Cloud TPU, GKE)",
    )
    multi.add_argument(
        "--coordinator",
        default=defaults["coordinator"],
        help="host:port of process 0's jax.distributed coordinator",
    )
    multi.add_argument(
        "--num-processes",
        type=_count,
        default=defaults["num_processes"],  # strings: argparse applies the type
        help="processes (hosts) of this island; above 1 initializes jax.distributed",
    )
    multi.add_argument(
        "--process-id",
        type=_index,
        default=defaults["process_id"],
        help="this process's index (0 writes the island's objects)",
    )
    sp.set_defaults(fn=cmd_island)

    sp = with_store(sub.add_parser("merge", help="apply committed pseudo-gradients"))
    sp.add_argument("--follow", action="store_true", help="keep merging until the run ends")
    sp.add_argument("--poll", type=float, default=1.0)
    sp.set_defaults(fn=cmd_merge)

    sp = with_store(sub.add_parser("eval", help="held-out loss of the model now (or a version)"))
    sp.add_argument(
        "--version", type=int, default=None, help="every fragment at this version (default: HEADs)"
    )
    sp.add_argument(
        "--record", action="store_true", help="record the eval and snapshot in the store"
    )
    sp.set_defaults(fn=cmd_eval)

    sp = with_store(sub.add_parser("export", help="a snapshot as safetensors + config.json"))
    sp.add_argument("--out", required=True, help="the directory to write (new or empty)")
    sp.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out whole (the new export is written beside it first)",
    )
    sp.add_argument(
        "--snapshot",
        default="head",
        help="head (default), best, final (the model a finished run ends with) or a version N",
    )
    sp.add_argument(
        "--format",
        choices=["safetensors", "orbax", "hf"],
        default="safetensors",
        help="orbax: also an Orbax checkpoint in DIR/orbax (safetensors + config.json always); "
        "hf: a transformers checkpoint instead (gemma presets, as Qwen3ForCausalLM)",
    )
    sp.set_defaults(fn=cmd_export)

    sp = sub.add_parser("sample", help="print a continuation of a prompt")
    sp.add_argument("--store", help="file:///path, gs://bucket/prefix (or --from DIR)")
    sp.add_argument("--experiment")
    sp.add_argument(
        "--from", dest="from_dir", metavar="DIR", help="an export directory (diloco export)"
    )
    sp.add_argument("--prompt", required=True, help="the text to continue")
    sp.add_argument(
        "--snapshot",
        default="head",
        help="head (default), best, final (the model a finished run ends with) or a version N",
    )
    sp.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    sp.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    sp.add_argument("--top-k", type=int, default=0, help="draw among the k likeliest (0: all)")
    sp.add_argument("--seed", type=int, default=0, help="PRNG seed of the draws")
    sp.set_defaults(fn=cmd_sample)

    sp = with_store(sub.add_parser("status", help="versions, islands, staleness, losses"))
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_status)

    sp = with_store(sub.add_parser("stop", help="ask islands to stop"))
    sp.add_argument("--island", default=None)
    sp.set_defaults(fn=cmd_stop)

    sp = with_store(sub.add_parser("delete", help="delete an experiment (not while it runs)"))
    sp.add_argument("--yes", action="store_true", help="delete without asking for its name")
    sp.set_defaults(fn=cmd_delete)

    sp = with_store(sub.add_parser("list", help="the experiments in a store"), experiment=False)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_list)

    sp = with_store(
        sub.add_parser("history", help="versions per fragment and snapshots, with times and evals")
    )
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_history)

    sp = with_store(
        sub.add_parser("replay", help="re-derive versions from their contributions, bit for bit")
    )
    sp.add_argument("--fragment", type=int, help="only this fragment (default: all)")
    sp.add_argument("--to", type=int, help="up to this version (default: HEAD)")
    sp.add_argument("--from", dest="start", type=int, default=1, help="from this version on")
    sp.add_argument("--keep-going", action="store_true", help="go on past a mismatch")
    sp.set_defaults(fn=cmd_replay)

    sp = with_store(
        sub.add_parser("report", help="charts (PNG, or SVG without matplotlib) and one HTML file")
    )
    sp.add_argument("--out", required=True, help="directory to write into (created)")
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser(
        "prepare", help="tokenize text, JSON lines or Parquet into token shards (docs/DATA.md)"
    )
    sp.add_argument("--data", required=True, help="files, a glob or a directory (fsspec URL)")
    sp.add_argument("--tokenizer", required=True, help="byte, a tokenizer.json or a .model")
    sp.add_argument("--out", required=True, help="where the shards go (fsspec URL)")
    sp.add_argument("--workers", type=_count, default=1, help="tokenizing processes")
    sp.add_argument("--text-field", default="text", help="the text's JSON field or column")
    sp.add_argument(
        "--chunk-mb", type=_count, default=64, help="input per shard (MiB; text files whole)"
    )
    sp.set_defaults(fn=cmd_prepare)

    # no help of its own: `diloco bench NAME --help` reaches the benchmark's parser
    sp = sub.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(BENCHES),
        add_help=False,
    )
    sp.add_argument("bench", nargs="?", choices=BENCHES)
    sp.set_defaults(fn=None)
    return p


BENCHES = {  # name -> the module whose main(argv) runs it
    "quality": "training.bench.quality",
    "goodput-sim": "training.bench.goodput_sim",
    "chaos": "training.bench.chaos",
    "merge": "training.bench.merge",
    "fetch": "training.bench.fetch",
    "wan": "training.bench.wan.bench",
    "science": "training.bench.science",
    "island": "training.bench.island",
    "scavenge": "training.bench.scavenge",
    "stream": "training.bench.stream",
    "device": "training.bench.device",
    "syncer": "training.bench.syncer",
    "light": "training.bench.light",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from training.store.objectstore import StoreError

    try:
        if args.command == "bench":
            if args.bench is None:
                print(f"usage: diloco bench {{{','.join(BENCHES)}}} [--help | options]")
                return 0 if {"-h", "--help"} & set(rest) else 2
            return cmd_bench(args, rest)
        return args.fn(args)
    except (ConfigError, StoreError, ValueError, RuntimeError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"diloco {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
