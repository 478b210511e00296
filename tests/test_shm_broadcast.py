"""The engine's broadcast to its workers: a shared-memory ring for readers on its machine,
ZeroMQ for readers on others (signed frames), with a heartbeat so a remote reader tells idle
from gone."""
import threading
import time

import pytest

from lane.distributed.rpc_auth import AuthError, RpcAuth
from lane.distributed.shm_broadcast import HEARTBEAT_S, SLOT_BYTES, SLOTS, MessageQueue, MessageReader
from utils import free_port


def test_every_reader_gets_every_message_in_order_and_a_remote_one_sees_the_writer_go():
    port = free_port()
    key = RpcAuth.random().key()
    mq = MessageQueue(num_local=2, num_remote=1, remote_port=port, remote_host="127.0.0.1", auth=RpcAuth(key))
    local = [MessageReader(mq.handle(), i) for i in range(2)]
    remote = MessageReader(mq.handle("127.0.0.1"), None, RpcAuth(key))
    mq.wait_for_readers(10)
    remote.wait_for_writer(HEARTBEAT_S * 3)  # its first signed heartbeat: subscribed, same secret
    big = b"x" * (SLOT_BYTES + 1)  # larger than a slot: travels inline
    msgs = [("execute_model", (i,), 0) for i in range(3 * SLOTS)] + [("big", (big,), None)]
    for i, m in enumerate(msgs):
        mq.enqueue(m, timeout_s=5)
        # the ring reuses a slot only once every local reader has flagged it read
        for r in local + [remote]:
            assert r.dequeue(timeout_s=5) == m, i
    # idle but alive: heartbeats keep coming (dequeue skips them: they are not messages)
    assert remote.socket.poll(int(HEARTBEAT_S * 3000))
    assert bytes(remote.auth.open(remote.socket.recv(copy=False).buffer)[1]) == b"h"
    t0 = time.monotonic()
    mq.close()
    assert remote.dequeue(timeout_s=HEARTBEAT_S * 2) is None  # the writer is gone: silence
    assert time.monotonic() - t0 < HEARTBEAT_S * 6
    for r in local + [remote]:
        r.close()


def test_a_remote_reader_with_another_secret_is_refused_and_reads_nothing():
    port = free_port()
    mq = MessageQueue(num_local=0, num_remote=1, remote_port=port, remote_host="127.0.0.1", auth=RpcAuth.random())
    wrong = MessageReader(mq.handle("127.0.0.1"), None, RpcAuth.random())
    try:
        with pytest.raises(AuthError, match="another secret"):
            wrong.wait_for_writer(HEARTBEAT_S * 3)
        mq.enqueue(("execute_model", (1,), 0))
        # a frame that does not check is dropped unread: the message never arrives
        assert wrong.dequeue(timeout_s=0.5) is None
    finally:
        wrong.close()
        mq.close()


def test_a_remote_queue_listens_on_the_named_interface_only():
    port = free_port()
    with pytest.raises(ValueError, match="needs an interface and an RPC secret"):
        MessageQueue(num_local=0, num_remote=1, remote_port=port)  # no host: never "*"
    mq = MessageQueue(num_local=0, num_remote=1, remote_port=port, remote_host="127.0.0.1", auth=RpcAuth.random())
    try:
        with open("/proc/net/tcp") as f:  # listening sockets: local address, state 0A
            rows = [line.split() for line in f.readlines()[1:]]
        listening = [r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port]
        assert listening == ["0100007F:%04X" % port]  # 127.0.0.1, not 0.0.0.0
    finally:
        mq.close()


def test_a_writer_waits_for_a_lagging_reader_then_fails_clearly_when_it_is_gone():
    mq = MessageQueue(num_local=2)
    fast, slow = MessageReader(mq.handle(), 0), MessageReader(mq.handle(), 1)
    mq.wait_for_readers(10)
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(fast.dequeue(5) for _ in range(SLOTS + 1)))
    reader.start()
    for i in range(SLOTS):  # fills the ring: nobody has read yet
        mq.enqueue(i, timeout_s=5)
    # the ring is full: the next message waits for the slow reader, who reads one after 0.5 s
    threading.Timer(0.5, slow.dequeue).start()
    t0 = time.monotonic()
    mq.enqueue(SLOTS, timeout_s=5)
    assert time.monotonic() - t0 >= 0.4
    # the slow reader is gone now: the writer gives up after its timeout, saying who lags
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"the ring is full: local reader\(s\) \[1\] have not read a message "
                                           r"for 0.5 s"):
        mq.enqueue("late", timeout_s=0.5)
    assert 0.4 <= time.monotonic() - t0 < 3
    reader.join(10)
    assert got == list(range(SLOTS + 1))  # the fast reader got every message in order
    fast.close()
    slow.close()
    mq.close()
