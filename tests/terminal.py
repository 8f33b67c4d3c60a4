"""Run a command on a pseudo-terminal, as a user at a shell would, and read what it draws there."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios


def on_a_terminal(argv: list[str], *, columns: int, stdout: bool = True, cwd=None, env=None) -> tuple[str, int]:
    """Run `argv` with stdin and stderr on a fresh terminal of 50 rows and `columns` columns (stdout too
    when `stdout`, else /dev/null); every byte it wrote there, decoded, and its exit status."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave if stdout else subprocess.DEVNULL, stderr=slave,
                            close_fds=True, cwd=cwd, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return b"".join(chunks).decode(errors="replace"), proc.wait(timeout=300)
