"""The attach watcher: one thread for every attach connection, each end reported exactly once.

Real Unix socket pairs stand for attach connections; the watcher holds the daemon's side (a
duplicate, as the daemon hook hands it over) and the test plays the engine's side. Killed
engine processes are covered end to end in test_daemon_presence.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from sglang_integration.daemon.attach_watcher import EOF_REASON, AttachWatcher, WatcherStopped

pytestmark = pytest.mark.timeout(60)


class Reports:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[str, str]] = []

    def __call__(self, key: str, reason: str) -> None:
        with self.lock:
            self.items.append((key, reason))

    def keys(self) -> list[str]:
        with self.lock:
            return [key for key, _ in self.items]

    def wait_for(self, count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.keys()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.keys())} of {count} reports arrived")
            time.sleep(0.005)


@pytest.fixture
def watched() -> Iterator[tuple[AttachWatcher, Reports]]:
    reports = Reports()
    watcher = AttachWatcher(reports)
    watcher.start()
    yield watcher, reports
    watcher.stop()


def attach_pair(watcher: AttachWatcher, key: str) -> socket.socket:
    """The engine's end; the daemon's end (a duplicate, like serve's conn.dup()) is watched."""
    engine_end, daemon_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    daemon_end.settimeout(30)  # as sglang's serve loop sets it, before the hook duplicates it
    watcher.watch(daemon_end.dup(), key)
    daemon_end.close()  # serve's conn.close() in its finally
    return engine_end


def test_one_thread_watches_many_connections(watched: tuple[AttachWatcher, Reports]) -> None:
    watcher, reports = watched
    threads_before = threading.active_count()
    engines = [attach_pair(watcher, f"engine-{n}") for n in range(64)]
    time.sleep(0.1)
    assert threading.active_count() == threads_before
    assert watcher.watched == 64 and reports.keys() == []
    for engine in engines:
        engine.close()
    reports.wait_for(64)
    assert sorted(reports.keys()) == sorted(f"engine-{n}" for n in range(64))
    assert watcher.watched == 0


def test_eof_is_reported_once_with_the_connections_key_and_others_stay_watched(
    watched: tuple[AttachWatcher, Reports],
) -> None:
    watcher, reports = watched
    first = attach_pair(watcher, "engine-A")
    second = attach_pair(watcher, "engine-B")
    first.close()
    reports.wait_for(1)
    time.sleep(0.05)
    assert reports.items == [("engine-A", EOF_REASON)]
    assert watcher.watched == 1
    second.close()
    reports.wait_for(2)
    assert reports.keys() == ["engine-A", "engine-B"]


def test_bytes_an_engine_sends_on_its_attach_connection_do_not_detach_it(
    watched: tuple[AttachWatcher, Reports],
) -> None:
    watcher, reports = watched
    engine = attach_pair(watcher, "engine-A")
    engine.sendall(b"x" * 100_000)
    time.sleep(0.1)
    assert reports.keys() == [] and watcher.watched == 1
    engine.close()
    reports.wait_for(1)


def test_a_process_exit_closes_the_connection_and_is_reported(
    watched: tuple[AttachWatcher, Reports],
) -> None:
    watcher, reports = watched
    engine_end, daemon_end = socket.socketpair()
    watcher.watch(daemon_end, "engine-child")
    pid = os.fork()
    if pid == 0:  # the engine: holds its end, then dies without closing anything
        os._exit(0)
    engine_end.close()  # only the child held it now; its exit closes it
    os.waitpid(pid, 0)
    reports.wait_for(1)
    assert reports.items == [("engine-child", EOF_REASON)]


def test_a_failing_callback_does_not_stop_the_watcher() -> None:
    seen: list[str] = []

    def on_closed(key: str, reason: str) -> None:
        seen.append(key)
        if key == "engine-bad":
            raise RuntimeError("ledger on fire")

    watcher = AttachWatcher(on_closed)
    watcher.start()
    try:
        attach_pair(watcher, "engine-bad").close()
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.005)
        attach_pair(watcher, "engine-good").close()
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert seen == ["engine-bad", "engine-good"]
    finally:
        watcher.stop()


def test_stop_closes_every_connection_without_reporting_and_refuses_new_ones() -> None:
    reports = Reports()
    watcher = AttachWatcher(reports)
    watcher.start()
    engines = [attach_pair(watcher, f"engine-{n}") for n in range(3)]
    watcher.stop()
    for engine in engines:
        engine.settimeout(5)
        assert engine.recv(1) == b""  # the daemon's side is closed
    assert reports.keys() == []
    _, late = socket.socketpair()
    with pytest.raises(WatcherStopped):
        watcher.watch(late, "engine-late")


def test_stop_is_not_lost_when_a_wake_up_drain_swallows_its_byte() -> None:
    """stop() landing while the thread drains earlier wake-ups: its byte is swallowed by that
    drain, so the thread must check the flag again before it selects, or it waits for ever."""
    watcher = AttachWatcher(Reports())
    real_drain = watcher._drain_wake_ups

    def drain_while_stop_lands() -> None:
        with watcher._lock:  # exactly what stop() does first: set the flag, then wake
            watcher._stopping = True
        watcher._wake()
        real_drain()  # swallows stop's byte along with the earlier ones

    watcher._drain_wake_ups = drain_while_stop_lands  # type: ignore[method-assign]
    watcher.start()
    engine = attach_pair(watcher, "engine")
    watcher._thread.join(timeout=30)
    assert not watcher._thread.is_alive()
    engine.close()
