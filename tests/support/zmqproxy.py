"""A ZMQ PUB/SUB forwarder that loses chosen frames: a dropped event stream, on demand."""

from __future__ import annotations

import threading

import zmq

from tests.support.ports import free_port


class DroppingProxy:
    """Forwards an engine's PUB frames to its own PUB port, dropping chosen seqs."""

    def __init__(self, upstream: str, drop: set[int] | None = None) -> None:
        self.port = free_port()
        #: Seqs to drop, and how many of the next frames to drop whatever their seq.
        self.drop = set(drop or ())
        self.drop_next = 0
        self.dropped: list[int] = []
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(f"tcp://127.0.0.1:{self.port}")
        self._monitor = self._pub.get_monitor_socket(zmq.EVENT_ACCEPTED)
        self._accepted = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def connected(self) -> bool:
        return self._accepted

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(50))
            if self._monitor in ready:
                self._monitor.recv_multipart()
                self._accepted = True
            if self._sub in ready:
                frames = self._sub.recv_multipart()
                seq = int.from_bytes(frames[1], "big")
                if seq in self.drop or self.drop_next > 0:
                    self.drop_next = max(self.drop_next - 1, 0)
                    self.dropped.append(seq)
                    continue
                self._pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.term()
