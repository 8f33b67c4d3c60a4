"""`python -c script args...` for tests, forked from a process that has already imported torch and defrag.

Many tests run a scenario in a process of its own (a registration that lasts
as long as the process, PyTorch's allocator swapped for the rest of it, a
crash that must fail the test instead of killing pytest). Each such process
spent most of its ~2 s importing torch. `run_python` gets the same process
from a *zygote*: a `python` started once per environment, which imports
torch and defrag (and loads defrag's native module), then forks one child per
scenario. The child is a fresh `python -c` in every way a scenario can see:
its own `__main__`, `sys.argv`, working folder, stdin from /dev/null, stdout
and stderr of its own, an exit through the interpreter's normal shutdown
(atexit handlers, finalizers), its exit status, or the signal that killed it,
as `subprocess` reports them. What it does not have: a first `import torch`
of its own (a scenario about import order, or about what importing does,
must use `subprocess` itself), and an environment other than the zygote's
(a call whose environment differs gets a zygote of its own). What the
zygote's imports made is frozen (`gc.freeze`): a child's collections walk
only the objects it made (a scenario that collects every few steps ran 7 s
instead of 1-3 s), and `gc.get_objects()` lists only those.

`NO_TEST_ZYGOTE=1` makes every call a plain `subprocess.run`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SERVER = r"""
import json, os, sys, types

def _preload():
    import torch  # noqa: F401
    import defrag  # noqa: F401
    try:
        from defrag import fastpath
        fastpath.wait()  # the native module, loaded (built on first use) once for every child
    except Exception:  # noqa: BLE001 - a child that needs it reports why itself
        pass
    import gc
    gc.collect()
    gc.freeze()  # what the imports made stays out of every child's collections (see the module's doc)

def _serve():
    replies = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    sys.argv = sys.argv[:1]
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(os.open(req["stdout"], os.O_WRONLY | os.O_TRUNC), 1)
            os.dup2(os.open(req["stderr"], os.O_WRONLY | os.O_TRUNC), 2)
            os.setpgid(0, 0)
            os.chdir(req["cwd"])
            sys.stdin = open(os.devnull)
            return req
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
    return None

_preload()
_req = _serve()
if _req is None:
    sys.exit(0)
_path = _req["path"]
sys.argv = [_path or "-c", *_req["args"]]
_main = types.ModuleType("__main__")
_main.__builtins__ = __builtins__
if _path:
    _main.__file__ = _path
sys.modules["__main__"] = _main
del _preload, _serve
exec(compile(_req["code"], _path or "<string>", "exec"), _main.__dict__)
"""


def _read(file) -> str:
    """All a child wrote to `file` (a temporary file it was given by name)."""
    file.seek(0)
    return file.read()


class _Zygote:
    """One server process for one environment; `run` forks a child of it per call."""

    def __init__(self, env: dict):
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(write_fd)], stdin=subprocess.PIPE,
                                     env=env, cwd=ROOT, pass_fds=(write_fd,), text=True)
        os.close(write_fd)
        self.replies, self._pending = read_fd, b""  # the server's reply lines, read unbuffered (select)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _reply(self, timeout: float | None) -> dict | None:
        """The server's next reply line, or None after `timeout` seconds (None: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.replies], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.replies, 65536)
            if not chunk:
                raise RuntimeError(f"the test zygote exited (rc={self.proc.poll()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def run(self, code: str, args: list[str], cwd: str, timeout: float, path: str | None) -> subprocess.CompletedProcess:
        with tempfile.NamedTemporaryFile("w+", prefix="zygote-out-") as out, \
                tempfile.NamedTemporaryFile("w+", prefix="zygote-err-") as err:
            self.proc.stdin.write(json.dumps({"code": code, "path": path, "args": args, "cwd": cwd, "stdout": out.name,
                                              "stderr": err.name}) + "\n")
            self.proc.stdin.flush()
            pid = self._reply(600)  # a new zygote imports torch and defrag first
            if pid is None:
                raise RuntimeError("the test zygote did not fork within 600 s")
            pid = pid["pid"]
            done = self._reply(timeout)
            if done is None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended meanwhile
                    pass
                self._reply(None)
                raise subprocess.TimeoutExpired(["python", path or "-c", *args], timeout, output=_read(out),
                                                stderr=_read(err))
            return subprocess.CompletedProcess(["python", path or "-c", *args], done["rc"], _read(out), _read(err))

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.close(self.replies)


_zygotes: dict[tuple, _Zygote] = {}
_PER_TEST = {"PYTEST_CURRENT_TEST"}  # set by pytest for each test: left out, or every test would start a zygote


def _close_all() -> None:
    for zygote in _zygotes.values():
        zygote.close()
    _zygotes.clear()


atexit.register(_close_all)


def checkout_env(**extra: str) -> dict:
    """os.environ with the checkout first on PYTHONPATH, plus `extra`: what a scenario's process gets."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_python(code: str, *args: str, env: dict | None = None, cwd: str = ROOT, timeout: float = 240,
               path: str | None = None) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
    cwd=cwd, timeout=timeout)` returns, from a child of the zygote for `env` (`checkout_env()` by default).

    `path`: the file `code` was read from, run as `python path args...` would run it (`sys.argv[0]`,
    `__file__`, tracebacks); the script's folder is on `sys.path` only when it is `cwd`."""
    env = checkout_env() if env is None else env
    env = {k: v for k, v in env.items() if k not in _PER_TEST}
    if os.environ.get("NO_TEST_ZYGOTE") == "1":
        argv = [path] if path else ["-c", code]
        return subprocess.run([sys.executable, *argv, *args], capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    key = tuple(sorted(env.items()))
    zygote = _zygotes.get(key)
    if zygote is None or not zygote.alive():
        zygote = _zygotes[key] = _Zygote(env)
    return zygote.run(code, list(args), cwd, timeout, path)


def run_module(module: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """What `python -m module args...` returns, from a child of the zygote (`run_python`'s keywords): the
    module runs as `__main__` through runpy with `sys.argv[0]` its file, as `-m` runs it. Its package is
    imported already (the zygote's): a scenario about what importing it does must use `subprocess`."""
    code = f"import runpy\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    return run_python(code, *args, **kwargs)


def run_clean(code: str, *args: str, ends_with: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`run_python`, failing the test unless the process exited 0 without a C++ `terminate` or an exception
    Python ignored (at exit, in a destructor), and, given `ends_with`, its stdout ends with that."""
    return check_clean(run_python(code, *args, **kwargs), ends_with=ends_with)


def check_clean(proc: subprocess.CompletedProcess, *, ends_with: str | None = None) -> subprocess.CompletedProcess:
    """`proc`, after failing the test unless it exited 0 without a C++ `terminate` or an exception Python
    ignored, and (given `ends_with`) its stdout ends with that."""
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "terminate called" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    if ends_with is not None:
        assert proc.stdout.rstrip().endswith(ends_with), proc.stdout
    return proc


# ---------------------------------------------------------------------- programs started early
# The suite runs on one core; a 2-core machine has the other mostly idle. A test module whose checks wait
# for whole programs that run a quarter of a minute or more (the benchmark smoke run, the gloo worlds, the
# GPU check) defines `start_early(items)`: tests/conftest.py calls it as the run starts (with its tests
# that were selected), it hands those programs to `start_early`, and its tests run last, reading the
# results with `early`. The programs run one after another, in one thread of this process: a program may
# start processes (subprocess), never use `run_python` (a zygote serves one call at a time).
# NO_EARLY_START=1 runs each when its test asks.
_early: dict[str, concurrent.futures.Future] = {}
_queue: queue.SimpleQueue = queue.SimpleQueue()
_worker: list[threading.Thread] = []


def _work() -> None:
    while True:
        done, fn, args = _queue.get()
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - raised again in the test that reads it
                done.set_exception(exc)


def start_early(key: str, fn, *args) -> None:
    """Queue `fn(*args)` to run beside the tests now, unless NO_EARLY_START=1; `early(key, fn, *args)`
    returns what it returned (or raises what it raised)."""
    if os.environ.get("NO_EARLY_START") == "1" or key in _early:
        return
    done: concurrent.futures.Future = concurrent.futures.Future()
    _early[key] = done
    _queue.put((done, fn, args))
    if not _worker:
        _worker.append(threading.Thread(target=_work, name="programs started early", daemon=True))
        _worker[0].start()


def early(key: str, fn, *args):
    """What `start_early(key, ...)` queued, once it is done; `fn(*args)` run now if nothing was queued."""
    done = _early.pop(key, None)
    if done is None:
        return fn(*args)
    if done.cancel():  # not started yet: run it here rather than wait for the queue
        return fn(*args)
    return done.result()
