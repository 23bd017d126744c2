"""Metrics over HTTP, the event-log timeline and goodput, during a run with a real fault."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from resilient import _timeline
from resilient.devservices import free_port

from .launch import REPO

pytestmark = pytest.mark.timeout(150)


def scrape(port: int) -> dict[str, float]:
    """``name{labels}`` → value, from a Prometheus text exposition."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        match = re.match(r"^(resilient_[^\s]+)\s+([-+0-9.eEinfaN]+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def listening_on(port: int) -> set[str]:
    """Addresses with a TCP socket listening on ``port`` (from /proc/net/tcp)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def eventually(fn, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except (AssertionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_metrics_and_timeline_show_the_fault_the_new_round_and_the_restore(cluster, tmp_path):
    cluster.steps = 120  # outlasts the fault at step 30 and the restart; no late joiner here
    run_log = str(tmp_path / "run.jsonl")
    ports = {"a": (free_port(), free_port()), "b": (free_port(), free_port())}
    nodes = {name: cluster.start(name, extra=[f"--metrics-port={agent}", f"--event-log={run_log}",
                                              *(["--metrics-addr=127.0.0.1"] if name == "a" else [])],
                                 env={"RESILIENT_METRICS_PORT": str(worker)})
             for name, (agent, worker) in ports.items()}
    cluster.wait_for(lambda e: e["event"] == "step" and e["step"] >= 30 and e["world"] == 2, 60, "world 2")
    assert scrape(ports["a"][1])["resilient_save_stall_seconds_count"] > 0  # a worker serves its metrics
    # --metrics-addr binds node a's agent and worker endpoints to loopback; b's to every interface
    assert listening_on(ports["a"][0]) == listening_on(ports["a"][1]) == {"127.0.0.1"}
    assert listening_on(ports["b"][0]) == {"0.0.0.0"}
    killed_at = time.time()
    nodes["b"].kill()
    resumed = cluster.wait_for(lambda e: e["event"] == "start" and e["t"] > killed_at, 30, "the resumed start")

    def agent_saw_it():
        m = scrape(ports["a"][0])
        assert m['resilient_membership_changes_total{cause="lost"}'] >= 1
        assert m["resilient_rendezvous_rounds_total"] >= 2 and m["resilient_world_size"] == 1
        assert m["resilient_detection_seconds_count"] >= 1 and m["resilient_reform_seconds_count"] >= 2
        assert 0 < m["resilient_goodput_ratio"] <= 1
        return m

    eventually(agent_saw_it)

    def worker_restored():
        m = scrape(ports["a"][1])
        assert m["resilient_restored_step"] == resumed["restored"]
        assert sum(v for k, v in m.items() if k.startswith("resilient_restore_seconds_count")) == 1
        return m

    eventually(worker_restored)
    assert nodes["a"].wait(90) == 0

    # the timeline of the same run, to the step
    out = subprocess.run([sys.executable, "-m", "resilient.ckpt", "timeline", run_log, "--json",
                          "--png", str(tmp_path / "t.png")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    train = cluster.events()
    old_rank0 = max(e["step"] for e in train if e["event"] == "step" and e["rank"] == 0 and e["t"] < killed_at)
    assert summary["final_step"] == max(e["step"] for e in train if e["event"] == "step") \
        == min(cluster.steps, resumed["restored"] + cluster.steps_after_resume)
    [recovery] = summary["recoveries"]
    assert recovery["restored"] == resumed["restored"]
    assert recovery["first_step"] == resumed["restored"] + 1
    assert recovery["last_step_before"] >= old_rank0
    assert recovery["nodes_after"] == 1 and "lost" in recovery["cause"]
    assert recovery["last_step_at"] < recovery["detected_at"] < recovery["round_formed_at"] \
        < recovery["restored_at"] < recovery["first_step_at"]
    assert summary["redone_steps"] == recovery["last_step_before"] - recovery["restored"]
    firsts = [e for e in _timeline.read_events(run_log) if e["event"] == "first_step"]
    assert firsts[-1]["step"] == recovery["first_step"] and abs(firsts[-1]["t"] - recovery["first_step_at"]) < 0.5
    # goodput is the kept steps' time over the run's wall time; each kept step slept
    # step_time (how much of the wall that is depends on the machine's load, not checked)
    assert 0 < summary["goodput"] < 1
    assert summary["goodput"] == pytest.approx(summary["useful_s"] / summary["wall_s"], abs=1e-3)
    assert summary["useful_s"] >= 0.5 * summary["final_step"] * cluster.step_time
    with open(tmp_path / "t.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    text = subprocess.run([sys.executable, "-m", "resilient.ckpt", "timeline", run_log], capture_output=True,
                          text=True, timeout=60, cwd=REPO).stdout
    assert f"restored step {resumed['restored']}" in text and "recovery: after step" in text


def _two_incarnations() -> list[dict]:
    """Steps 1..10, a lost node, a restore of step 6 and steps 7..12 again, 1 s a step."""
    def ev(t, event, pid, **f):
        return {"t": t, "event": event, "rank": 0, "pid": pid, **f}

    events = [ev(0.0, "restored", 1, step=0, source=None)]
    events += [ev(float(s), "step", 1, step=s) for s in range(1, 11)]          # steps 1..10, 1 s each
    events += [{"t": 12.0, "event": "membership_change", "rank": -1, "pid": 9, "cause": "lost", "detail": "lost x"}]
    events += [ev(14.0, "restored", 2, step=6, source="local")]                # 7..10 lost
    events += [ev(14.0 + s - 6, "step", 2, step=s) for s in range(7, 13)]      # 7..12 again, 1 s each
    return events


def test_goodput_counts_only_kept_steps():
    timeline = _timeline.build(_two_incarnations())
    assert timeline.redone_steps == 4
    assert timeline.useful_s == pytest.approx(6 + 6)                           # 1..6 from the first, 7..12
    assert timeline.wall_s == pytest.approx(20)
    assert timeline.goodput == pytest.approx(12 / 20)
    [r] = _timeline.recoveries(timeline)
    assert (r["last_step_before"], r["restored"], r["first_step"]) == (10, 6, 7)


def test_timeline_of_an_empty_or_missing_log_is_a_clear_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    for path in (tmp_path / "empty.jsonl", tmp_path / "missing.jsonl"):
        out = subprocess.run([sys.executable, "-m", "resilient.ckpt", "timeline", str(path)],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 1 and str(path) in out.stderr and "Traceback" not in out.stderr


def test_lines_of_another_shape_in_the_log_are_skipped_and_named(tmp_path):
    """The log is appended to by every process of a run (or concatenated from several
    nodes): a line of another shape is skipped, named in a warning, and the timeline is the
    one the well-formed lines tell (one such line, a ``t`` that is text, made it fail)."""
    events = _two_incarnations()
    strays = ['{"t": "12:00", "event": "step", "rank": 0, "pid": 1, "step": 11}',  # t as text
              '{"t": 3.5, "event": "step", "rank": 0, "pid": 1, "step": "4"}',      # step as text
              '[1, 2]', 'null', '{"t": 1e999, "event": "x"}', '{"t": 4.5, "event": "regrouped", "gen": 1}',
              '{"t": 4.6, "event": "restored", "rank": 0, "pid": [1], "step": 0}']
    lines = [json.dumps(e) for e in events]
    for i, stray in enumerate(strays):
        lines.insert(2 + 2 * i, stray)
    (tmp_path / "clean.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + '\n{"t": 30.0, "event": "st')  # a torn last line
    runs = {name: subprocess.run([sys.executable, "-m", "resilient.ckpt", "timeline", str(tmp_path / name), "--json"],
                                 capture_output=True, text=True, timeout=60, cwd=REPO)
            for name in ("clean.jsonl", "mixed.jsonl")}
    assert all(r.returncode == 0 for r in runs.values()), runs["mixed.jsonl"].stderr[-3000:]
    assert json.loads(runs["mixed.jsonl"].stdout) == json.loads(runs["clean.jsonl"].stdout)
    assert json.loads(runs["clean.jsonl"].stdout)["redone_steps"] == 4 and runs["clean.jsonl"].stderr == ""
    warning = runs["mixed.jsonl"].stderr
    assert "skipped 8 line(s)" in warning and "(line 3, 5, 7, 9, 11, ...)" in warning, warning
