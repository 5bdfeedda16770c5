"""loadtest.device_sim: the simulated accelerator gives FakeRunner's tokens whether the carried rows'
tokens are read on the "device" or put in on the host, and the CLI prints its table. No timing is
asserted: the figures are for reading (docs/benchmarks.md), not for a test on a loaded machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fakes import greedy_through_loop

from loadtest import device_sim
from scheduler.config import SchedulerConfig
from scheduler.fake_runner import FakeRunner

PROMPTS = [[100 + i, 200 + i, 300 + i] for i in range(5)]


@pytest.mark.parametrize("carry", [True, False])
async def test_the_simulated_device_gives_the_runners_tokens(carry: bool):
    device = device_sim.SimulatedDevice(0.0005, carry)
    submitted = []
    submit = device.submit

    def noting_submit(batch, carry=None):
        submitted.append(carry is not None)
        return submit(batch, carry)

    device.submit = noting_submit
    config = SchedulerConfig(overlap_schedule=True, speculative="off")
    try:
        got = await greedy_through_loop(device, PROMPTS, 12, config)
    finally:
        device.close()
    want = await greedy_through_loop(FakeRunner(), PROMPTS, 12, SchedulerConfig(overlap_schedule=False))
    assert got == want
    assert any(submitted) is carry  # carried steps were queued only where the device carries


def test_the_cli_prints_both_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "sim.json"
    device_sim.main(
        ["--step-ms", "0.2", "--streams", "2", "--new-tokens", "6", "--repeats", "1", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    assert "carried on the device" in printed and "put in on the host" in printed
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["put in on the host", "carried on the device"]
    assert all(r["streams"] == 2 and r["tpot_ms"] > 0 and r["step_ms"] > 0 for r in rows)
