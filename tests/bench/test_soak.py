"""`omni-bench soak`'s reading of /health (which instances are down) and its recovery table
per kind of victim process and fault (the numbers the soak reports for each fault kind)."""

from __future__ import annotations

from omni_bench.soak import Fault, named_down, recovery_by_kind


def test_the_instances_health_names_down() -> None:
    assert named_down({"status": "ok", "detail": "every stage process is up"}) == set()
    degraded = {"status": "degraded", "detail": "voice@r1 restarting; asr@r0 failed"}
    assert named_down(degraded) == {"voice@r1", "asr@r0"}
    unavailable = {
        "status": "unavailable",
        "detail": "no live replica of thinker (thinker@r0 restarting; voice@r0 restarting)",
    }
    assert named_down(unavailable) == {"thinker@r0", "voice@r0"}


def test_recovery_is_reported_per_process_and_fault_kind() -> None:
    faults = [
        Fault("SIGKILL", "thinker@r0", 0.0, detected_s=0.1, recovered_s=4.0),
        Fault("SIGKILL", "thinker@r0", 0.0, detected_s=0.2, recovered_s=8.0),
        Fault("SIGKILL", "thinker@r0", 0.0, detected_s=0.3, recovered_s=5.0),
        Fault("SIGSTOP", "voice@r0", 0.0, detected_s=6.0, recovered_s=9.0),
        Fault("SIGSTOP", "voice@r1", 0.0, detected_s=6.5, recovered_s=None),  # never back
    ]
    rows = {
        tuple(cell.strip() for cell in line.strip("|").split("|"))[:2]: line
        for line in recovery_by_kind(faults)[2:]
    }
    assert set(rows) == {("thinker", "SIGKILL"), ("voice", "SIGSTOP")}
    thinker = [c.strip() for c in rows[("thinker", "SIGKILL")].strip("|").split("|")]
    assert thinker[2:] == ["3", "3", "5.00", "8.00", "0.20"]  # faults, recovered, median, max
    voice = [c.strip() for c in rows[("voice", "SIGSTOP")].strip("|").split("|")]
    assert voice[2:] == ["2", "1", "9.00", "9.00", "6.25"]
