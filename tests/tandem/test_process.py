"""A spare's gate: it opens on `go`, and a spare whose supervisor closes its stdin exits without serving."""

from __future__ import annotations

import io

from tandem.process import run_component, wait_for_go


def test_the_gate_opens_on_go_only():
    assert wait_for_go(io.StringIO("go\n"))
    assert not wait_for_go(io.StringIO(""))  # stdin closed: stopped, or its supervisor died
    assert not wait_for_go(io.StringIO("stop\n"))


def test_a_spare_released_without_go_reads_no_config_and_exits_0():
    loaded = []

    async def main(config) -> None:
        raise AssertionError("served")

    assert run_component("test", lambda: loaded.append(1), main, lambda: wait_for_go(io.StringIO(""))) == 0
    assert loaded == []


def test_an_opened_gate_reads_the_config_then_serves():
    order = []

    def gate() -> bool:
        order.append("gate")
        return True

    async def main(config) -> None:
        order.append(config)

    assert run_component("test", lambda: order.append("load") or "config", main, gate) == 0
    assert order == ["gate", "load", "config"]
