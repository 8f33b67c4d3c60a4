"""`defrag replay` as a user meets it (issue 46): its workers die with it, a history `defrag run --record`
wrote is described as that run, and every line it prints is one a user can act on."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from defrag.traces.format import ALLOC, FREE, Trace

MiB = 1 << 20
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


# ---------------------------------------------------------------------- workers end with their parent
def _children(pid: int) -> set[int]:
    """The live (not zombie) processes whose parent is `pid`."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out.add(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


BUSY_REPLAY = textwrap.dedent("""
    import sys
    from defrag import cli, replay

    def busy(*args, **kwargs):  # a replay that takes as long as the test needs: forever
        while True:
            pass

    replay._run_dry = busy  # the forked workers inherit it
    replay.default_workers = lambda: 2
    sys.exit(cli.main(["replay", sys.argv[1], "--capacity", "64MiB", "--dry"]))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_workers_of_a_replay_end_when_its_process_is_killed(tmp_path):
    """A replay killed by a timeout or the OOM killer gets no chance to stop its workers: they end on their
    own, at once, instead of keeping a core each busy until their replay is done."""
    path = Trace([(ALLOC, i, MiB) for i in range(8)] + [(FREE, i) for i in range(8)], name="t").save(
        tmp_path / "t.jsonl")
    proc = subprocess.Popen([sys.executable, "-c", BUSY_REPLAY, str(path)], env=_env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            workers = _children(proc.pid)
        assert len(workers) == 2, (proc.poll(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)], "the workers outlived their parent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:  # before the fix: the busy workers this test started, one by one
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        proc.stderr.close()
