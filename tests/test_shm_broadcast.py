"""The engine's broadcast to its workers: a shared-memory ring for readers on its machine,
ZeroMQ for readers on others, with a heartbeat so a remote reader tells idle from gone."""
import time

from lane.distributed.shm_broadcast import HEARTBEAT_S, SLOT_BYTES, SLOTS, MessageQueue, MessageReader
from utils import free_port


def test_every_reader_gets_every_message_in_order_and_a_remote_one_sees_the_writer_go():
    port = free_port()
    mq = MessageQueue(num_local=2, num_remote=1, remote_port=port, remote_host="127.0.0.1")
    local = [MessageReader(mq.handle(), i) for i in range(2)]
    remote = MessageReader(mq.handle("127.0.0.1"), None)
    mq.wait_for_readers(10)
    big = b"x" * (SLOT_BYTES + 1)  # larger than a slot: travels inline
    msgs = [("execute_model", (i,), 0) for i in range(3 * SLOTS)] + [("big", (big,), None)]
    for i, m in enumerate(msgs):
        mq.enqueue(m, timeout_s=5)
        # the ring reuses a slot only once every local reader has flagged it read
        for r in local + [remote]:
            assert r.dequeue(timeout_s=5) == m, i
    # idle but alive: heartbeats keep coming (dequeue skips them: they are not messages)
    assert remote.socket.poll(int(HEARTBEAT_S * 3000)) and bytes(remote.socket.recv()) == b"h"
    t0 = time.monotonic()
    mq.close()
    assert remote.dequeue(timeout_s=HEARTBEAT_S * 2) is None  # the writer is gone: silence
    assert time.monotonic() - t0 < HEARTBEAT_S * 6
    for r in local + [remote]:
        r.close()
