"""Progress on stderr (baton/progress.py, and serving/logs.py's stderr wrapper): redrawn in place
on a terminal (a real pty here), a few plain milestone lines and never a '\\r' anywhere else,
whether Baton draws it or a library's tqdm bar does."""
from __future__ import annotations

import io
import os
import pty
import select

import pytest
from tqdm import tqdm

from baton.progress import Progress
from baton.serving.logs import Lines, json_line


@pytest.fixture
def terminal():
    """A writable end of a real pseudo-terminal, and a reader of what it showed."""
    main, side = pty.openpty()
    out = os.fdopen(side, "w")

    def shown() -> str:
        out.flush()
        got = b""
        while select.select([main], [], [], 0.2)[0]:      # until it has shown everything
            got += os.read(main, 1 << 16)
        return got.decode()
    yield out, shown
    out.close()
    os.close(main)


def test_off_a_terminal_a_task_prints_its_quarters_and_its_end_never_a_carriage_return():
    out = io.StringIO()
    progress = Progress("capturing decode graphs", 100, out=out)
    for i in range(1, 101):
        progress.update(i)
    progress.done("captured 100 decode graphs")
    assert "\r" not in out.getvalue()
    assert out.getvalue().splitlines() == [f"[baton] capturing decode graphs: {i}/100" for i in (1, 25, 50, 75)] \
        + ["[baton] captured 100 decode graphs"]


def test_on_a_terminal_a_task_redraws_one_line_in_place(terminal):
    out, shown = terminal
    progress = Progress("loading weights", 3, "files", out=out)
    for i in range(1, 4):
        progress.update(i)
    progress.done("loaded")
    text = shown()
    assert text.count("\r[baton] loading weights:") == 3 and text.count("\n") == 1
    assert text.rstrip().endswith("\r[baton] loaded")     # padded over the longer line it replaces


def library_bar(out, total: int = 272) -> None:
    for _ in tqdm(range(total), desc="Converting GGUF tensors", file=out, mininterval=0):
        pass


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_library_bar_off_a_terminal_becomes_a_few_plain_lines(fmt):
    out = io.StringIO()
    stderr = Lines(out, json_line if fmt == "json" else None)
    print("[baton] converting ...", file=stderr)
    library_bar(stderr)
    stderr.write("a line a library ends Windows-style\r\n")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and not stderr.isatty()
    bar = [line for line in lines if "Converting GGUF tensors" in line]
    assert len(bar) == 5 and "0/272" in bar[0] and "272/272" in bar[-1]     # 0, 25, 50, 75 %, the end
    assert "converting ..." in lines[0] and "Windows-style" in lines[-1] and len(lines) == 7


def test_a_library_bar_on_a_terminal_is_drawn_as_it_comes(terminal):
    out, shown = terminal
    stderr = Lines(out)
    library_bar(stderr, total=20)
    text = shown()
    assert stderr.isatty() and text.count("\r") > 10 and "20/20" in text
