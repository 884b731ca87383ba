"""The CLI's progress line (training/views/progress.py): drawn on a TTY only, erased when done."""

from __future__ import annotations

import io

from training.views.progress import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_tty_gets_a_redrawn_line_that_is_erased_at_the_end():
    tty = Tty()
    with Progress("report", total=2, stream=tty, width=4) as bar:
        bar.step("reading the store")
        assert tty.getvalue().startswith("\r[##..] 1/2 report: reading the store")
        bar.step("charts")
    text = tty.getvalue()
    assert "\r[####] 2/2 report: charts" in text
    assert text.endswith("\r") and text.rsplit("\r", 2)[-2].strip() == ""


def test_nothing_is_written_when_the_stream_is_not_a_tty():
    pipe = io.StringIO()
    with Progress("eval", total=2, stream=pipe) as bar:
        bar.step("x")
        bar.step("y")
    assert pipe.getvalue() == ""
