"""fitburst.quick_exit: a fitburst process ends as Python's exit ends it (threads joined and their hooks run,
``atexit`` handlers, stdout and stderr flushed, the status given) without the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROCESS = textwrap.dedent("""
    import atexit, os, sys, threading, time
    from fitburst.quick_exit import exit_after_cleanup

    class Torn:
        def __del__(self, write=os.write):  # bound now: teardown may have cleared this module's globals by then
            write(1, b"torn down")  # the file descriptor: still open when teardown has closed sys.stdout

    kept = Torn()  # a module global: only the interpreter's teardown deletes it
    def late():
        time.sleep(0.5)
        print("thread done", flush=True)
    threading.Thread(target=late).start()  # not a daemon: a normal exit waits for it
    threading._register_atexit(lambda: print("thread hook", flush=True))  # how Prefect drains its services
    atexit.register(lambda: print("atexit", flush=True))
    sys.stdout.write("unflushed")
    sys.stderr.write("to stderr")
    exit_after_cleanup(3)
    print("not reached")
""")


def test_a_process_ends_as_pythons_exit_without_teardown():
    proc = subprocess.run([sys.executable, "-c", PROCESS], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["unflushedthread hook", "thread done", "atexit"]
    assert proc.stderr == "to stderr"


def test_the_fitburst_command_ends_through_it():
    """``fitburst``'s entry ends with main's status, and no teardown (the many CLI tests check its output)."""
    code = ("import os\n"
            "from fitburst import cli\n"
            "class Torn:\n"
            "    def __del__(self, write=os.write):\n"
            "        write(1, b'torn down')\n"
            "kept = Torn()\n"
            "cli.main = lambda: print('main', end='') or 5\n"
            "cli.entry()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert (proc.returncode, proc.stdout) == (5, "main"), proc.stderr[-2000:]
