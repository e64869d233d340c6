"""The failure monitor's thread and its stop (megacann.training.failure)."""

from __future__ import annotations

import threading

from megacann.training.failure import FailureMonitor


def test_a_monitor_stopped_before_its_thread_runs_never_connects_to_the_store():
    """A rank whose run ends before the monitor thread was scheduled (a short run on a busy CPU) must not
    have that thread connect afterwards: the store may already be gone, and the connection attempt would
    outlast stop()'s wait, leaving the thread alive after shutdown."""
    connections = []
    monitor = FailureMonitor(0, 2, grace_s=1.0, store_factory=lambda: connections.append("connect"))
    monitor.stop()  # the run ended first
    monitor.start()
    monitor.stop()  # joins the thread
    assert connections == []
    assert not any(t.name == "megacann-failure-monitor" and t.is_alive() for t in threading.enumerate())
