"""Lock files that let several workers share a grid: a cell (or a dataset being
prepared) is claimed by creating its lock with the worker's host and pid; a lock whose
process is gone is taken over.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def claim(lock: Path) -> bool:
    """Take ``lock`` for this process; False if another live process on this host holds it.

    A lock from a dead process (or an unreadable one) is stale and taken over. Locks from
    another host are respected (no way to check them), so remove those by hand if needed.
    """
    lock.parent.mkdir(parents=True, exist_ok=True)
    me = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                host, pid = lock.read_text(encoding="utf-8").split()
                holder_alive = host != socket.gethostname() or pid_alive(int(pid))
            except (OSError, ValueError):
                holder_alive = False
            if holder_alive:
                return f"{host} {pid}" == me
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(me)
        return True
    return False


def release(lock: Path) -> None:
    lock.unlink(missing_ok=True)
