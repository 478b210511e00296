"""Shared-memory collectives between real processes: equal to gloo's results for every op and
dtype, chunked past a slot, sizes that do not divide by the ranks; a peer that exits or stalls
fails the collective (never a hang); more ranks than cores still make progress."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from lane.model_executor.layers import cpu_kernels

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.skipif(not cpu_kernels.build(), reason="the shared-memory collectives are compiled kernels")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, case: str, timeout: float = 30.0, slot_bytes: int | None = None) -> list[dict]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    if slot_bytes:
        env["LANE_SHM_SLOT_BYTES"] = str(slot_bytes)
    port = _port()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "shm_ranks.py"), "--rank", str(r), "--world",
                               str(world), "--port", str(port), "--case", case, "--timeout", str(timeout)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        results.extend(lines)
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_every_op_and_dtype_equals_gloo(world):
    # a 4 KiB slot: the 1001-row tensors go through in chunks
    results = _run(world, "ops", slot_bytes=4096)
    assert len(results) == world and all(r["checked"] == 5 * 3 * 6 for r in results)
    assert all(not r["segment_left"] for r in results), "the segment is unlinked once every rank mapped it"


def test_a_peer_that_exits_fails_the_collective_at_once():
    [r0] = _run(2, "peer-exits", timeout=60.0)
    assert "rank 1 of 2 exited" in r0["error"] and r0["seconds"] < 30


def test_a_peer_that_stalls_fails_the_collective_after_the_timeout():
    [r0] = _run(2, "peer-stalls", timeout=2.0)
    assert "did not arrive within 2 s" in r0["error"] and 1.5 < r0["seconds"] < 30


def test_four_ranks_on_two_cores_make_progress():
    results = _run(4, "many", timeout=60.0)
    assert len(results) == 4 and all(r["seconds"] < 60 for r in results)
