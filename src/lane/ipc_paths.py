"""Where lane's processes meet on one machine: IPC directories and shared-memory files named
after the process that made them (``lane-<kind>-<pid>-<random>``), so that the next start
removes what a process killed without a word (SIGKILL, OOM) left behind."""
from __future__ import annotations

import os
import re
import shutil
import tempfile

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_OURS = re.compile(r"lane-[a-z]+-(\d+)-")
_swept = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale() -> list[str]:
    """Remove this user's lane IPC dirs and shared-memory files whose owner process is gone."""
    removed = []
    for base in {tempfile.gettempdir(), SHM_DIR}:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            m = _OURS.match(name)
            path = os.path.join(base, name)
            if not m or _alive(int(m.group(1))):
                continue
            try:
                if os.lstat(path).st_uid != os.getuid():
                    continue
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
                removed.append(path)
            except OSError:
                pass  # another start removed it first
    return removed


def _sweep_once() -> None:
    global _swept
    if not _swept:
        _swept = True
        remove_stale()


def make_ipc_dir(kind: str) -> str:
    """A new private (0700) directory for this process's IPC sockets."""
    _sweep_once()
    return tempfile.mkdtemp(prefix=f"lane-{kind}-{os.getpid()}-")


def shm_file_path(kind: str) -> str:
    """A new name for a shared-memory file of this process's (the caller creates it 0600)."""
    _sweep_once()
    return os.path.join(SHM_DIR, f"lane-{kind}-{os.getpid()}-{os.urandom(6).hex()}")
