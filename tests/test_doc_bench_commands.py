"""Every benchmark command docs/BENCHMARKS.md prints is accepted, as printed, by the benchmark's
own argument parser (`diloco bench NAME ...`, `python -m training.bench...`): a flag renamed or
dropped fails here, not in a user's terminal. Parsing only: the parser's successful return is
intercepted (`Parsed`), so nothing runs. The benchmarks themselves run in CI's slow suite or by
hand (their tables say when).

Lines with placeholders (`[...]`, `$OLD`, `{a,b}`, a bare `S` / `G` / `RULE`) are recipes, not
commands, and are skipped; the history files (docs/bench-history/) keep old commands on purpose."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from training.cli import BENCHES

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"[\[\]${}]|(?<![\w/.-])(S|G|RULE)(?![\w/.-])|=RULE\b")


def _commands() -> list[str]:
    out, fenced = [], False
    for line in (ROOT / "docs/BENCHMARKS.md").read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        text = line.strip()
        if fenced and text.startswith(("diloco bench ", "python -m training.bench")):
            out.append(text)
    return out


COMMANDS = _commands()


class Parsed(Exception):
    """A parser returned: the command line was accepted."""


@pytest.fixture
def parse_only(monkeypatch):
    real = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        got = real(self, args, namespace)
        if got[1]:  # leftovers: parse_args refuses them, or the bench forwards them on
            return got
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)


def test_the_page_prints_benchmark_commands():
    assert len(COMMANDS) >= 20  # a parse of the page that finds none would pass every case


@pytest.mark.parametrize("line", COMMANDS)
def test_a_printed_benchmark_command_is_accepted_by_its_parser(line, parse_only):
    argv = shlex.split(line, comments=True)
    if PLACEHOLDER.search(" ".join(argv)):
        pytest.skip("a recipe with placeholders")
    if argv[:2] == ["diloco", "bench"]:
        module, args = BENCHES[argv[2]], argv[3:]
    else:
        assert argv[:2] == ["python", "-m"], line
        module, args = argv[2], argv[3:]
    with pytest.raises(Parsed):
        importlib.import_module(module).main(args)
