"""A real `lane serve` in a subprocess on a free loopback port (as vLLM's tests'
RemoteOpenAIServer): started, waited for, stopped with SIGTERM."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, timeout_s: float = 240.0,
                 api_key: str | None = None, launcher: list[str] | None = None) -> None:
        """``launcher``: the command line before ``serve`` (default: python -m lane.entrypoints.cli)."""
        self.port = free_port()
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="lane-serve-", suffix=".log", delete=False)
        launcher = launcher or [sys.executable, "-m", "lane.entrypoints.cli"]
        cmd = [*launcher, "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "LANE_LOGGING_LEVEL": "INFO", **(env or {})})
        self._wait_healthy(timeout_s)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lane serve exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"lane serve not healthy after {timeout_s} s:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def engine_pids(self) -> list[int]:
        m = re.search(r"engine core\(s\) \(pids ([0-9, ]+)\)", self.read_log())
        return [int(p) for p in m.group(1).split(",")] if m else []

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=kw.pop("timeout", 120), **kw)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def __enter__(self) -> "RemoteServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        os.unlink(self.log.name)

def start_proxy(prefill_port: int, decode_port: int, *args: str) -> tuple[subprocess.Popen, str]:
    """A real `lane proxy` in front of one prefill and one decode instance: (its process, its URL)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lane.entrypoints.cli", "proxy", "--port", str(port),
                             "--prefiller-ports", str(prefill_port), "--decoder-ports", str(decode_port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "timeout"
        time.sleep(0.2)


def descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().split(")")[-1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def metric(text: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include the given ones."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        lbl = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(lbl.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name}{labels} not in /metrics"
    return total


def pid_alive(pid: int) -> bool:
    """Whether a process runs (a zombie has exited, though kill(pid, 0) still finds it)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
