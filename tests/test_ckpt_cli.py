"""resilient-ckpt on checkpoints made by the engine: local roots and the S3 server."""

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from resilient import Checkpointer
from resilient.ckpt import main

from .faults import flip_byte
from .launch import REPO, run_ranks

pytestmark = pytest.mark.timeout(180)


def make_state(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "meta": {"epoch": seed, "name": "run"},
            "emb": torch.randn(10, 3).to(torch.bfloat16)}


@pytest.fixture(scope="module")
def local_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cli") / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, make_state(step))
    return root


@pytest.fixture(scope="module")
def dtensor_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cli-dt") / "ckpt")
    run_ranks("dtensor_save", 2, {"root": root, "uint4": False}, env={"FORCE_DIST": "1"})
    return root


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_json_is_ascending_with_stable_fields(capsys, local_root):
    code, out, _ = run(capsys, "ls", local_root, "--json")
    rows = json.loads(out)
    assert code == 0
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(rows[0]) == {"step", "state", "tiers", "bytes", "world_size", "created", "problem"}
    assert rows[0]["state"] == "committed" and rows[0]["tiers"] == ["local"] and rows[0]["world_size"] == 1
    code, out, _ = run(capsys, "ls", local_root)
    assert out.splitlines()[0].split()[:3] == ["STEP", "STATE", "TIERS"] and "\033[" not in out


def test_show_lists_tensors_and_values(capsys, local_root, dtensor_root):
    code, out, _ = run(capsys, "show", local_root, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["step"] == 3
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert by_name["model/0.weight"]["dtype"] == "float32" and by_name["model/0.weight"]["shape"] == [16, 8]
    assert by_name["emb"]["dtype"] == "bfloat16" and by_name["emb"]["bytes"] == 60
    assert {"name": "meta/epoch", "value": 3} in doc["values"]
    code, out, _ = run(capsys, "show", dtensor_root, "--step", "5", "--json")
    by_name = {t["name"]: t for t in json.loads(out)["tensors"]}
    assert by_name["t/a"]["shards"] == 2 and by_name["t/a"]["shape"] == [10, 6]


def test_verify_finds_a_flipped_byte_and_ls_shows_damage(capsys, tmp_path):
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(1, make_state(1))
        ckpt.save(2, make_state(2))
    assert run(capsys, "verify", root)[0] == 0
    data = os.path.join(root, "step-0000000002", "rank-00000.data")
    flip_byte(data, 100)
    code, _, err = run(capsys, "verify", root, "--step", "2")
    assert code == 1 and "step 2" in err and "checksum mismatch" in err
    code, out, _ = run(capsys, "ls", root, "--verify", "--json")
    assert code == 1 and [r["state"] for r in json.loads(out)] == ["committed", "corrupt"]
    with open(data, "r+b") as f:
        f.truncate(50)
    code, out, _ = run(capsys, "ls", root, "--json")  # a size check needs no --verify
    assert code == 1 and json.loads(out)[1]["state"] == "corrupt"
    assert "step 2" in run(capsys, "verify", root, "--all")[2]


def test_diff_reports_changes_and_structure(capsys, local_root, tmp_path):
    code, out, _ = run(capsys, "diff", local_root, "1", "2", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["added"] == [] and doc["removed"] == []
    changed = {c["name"]: c for c in doc["changed"]}
    a = Checkpointer(local_root)
    assert changed["model/0.weight"]["max_abs_diff"] > 0
    assert {"name": "meta/epoch", "a": 1, "b": 2} in doc["values_changed"]
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        ckpt.save(1, {"x": torch.ones(3), "y": torch.zeros(2)})
        ckpt.save(2, {"x": torch.ones(4), "z": torch.zeros(2)})
    doc = json.loads(run(capsys, "diff", root, "1", "2", "--json")[1])
    assert doc["added"] == ["z"] and doc["removed"] == ["y"]
    assert doc["changed"][0]["name"] == "x" and doc["changed"][0]["from"] == "float32[3]"
    a.close()


def _same_nested(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same_nested, a, b))
    return a == b


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_export_round_trips_with_each_library(capsys, local_root, tmp_path, fmt):
    out = str(tmp_path / f"export.{fmt}")
    code, _, err = run(capsys, "export", local_root, out, "--format", fmt)
    assert code == 0 and "exported step 3" in err
    state = make_state(3)
    expected = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict(), "meta": state["meta"],
                "emb": state["emb"]}
    if fmt == "torch":
        loaded = torch.load(out, weights_only=True)
        assert _same_nested(dict(expected["model"]), loaded["model"])
        assert _same_nested(expected["optim"], loaded["optim"])
        assert loaded["meta"] == {"epoch": 3, "name": "run"} and torch.equal(loaded["emb"], state["emb"])
    elif fmt == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        loaded = load_file(out)
        assert torch.equal(loaded["model.0.weight"], expected["model"]["0.weight"])
        assert torch.equal(loaded["optim.state.0.exp_avg"], expected["optim"]["state"][0]["exp_avg"])
        with safe_open(out, "pt") as f:
            assert json.loads(f.metadata()["resilient.values"])["meta.epoch"] == 3
    else:
        import torch.distributed.checkpoint as dcp

        template = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()},
                    "emb": torch.zeros_like(state["emb"])}
        dcp.load(template, checkpoint_id=out, no_dist=True)
        assert _same_nested(dict(expected["model"]), template["model"]) and torch.equal(template["emb"], state["emb"])
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no scratch left


def test_export_of_dtensor_checkpoint_is_world_size_free(capsys, dtensor_root, tmp_path):
    from .workers import dtensor_box_tensors_full

    out = str(tmp_path / "t.pt")
    assert run(capsys, "export", dtensor_root, out, "--format", "torch", "--key", "t")[0] == 0
    loaded = torch.load(out, weights_only=True)
    for name, full in dtensor_box_tensors_full(uint4=False).items():
        assert torch.equal(loaded[name], full), name


def test_export_refuses_a_dtype_the_format_cannot_hold_before_reading_naming_the_tensor(capsys, tmp_path):
    """torch.save has no uint4, DCP no bits8: the export stops at once, naming the tensor and
    the formats that can hold it, instead of torch's KeyError after assembling the state."""
    root = str(tmp_path / "ckpt")
    bits = torch.arange(8, dtype=torch.uint8).view(torch.bits8)
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.ones(3), "packed": {"bits": bits}})
        ckpt.save(2, {"w": torch.ones(3), "packed": {"bits": bits, "q": torch.zeros(4, dtype=torch.uint8).view(torch.uint4)}})
    code, _, err = run(capsys, "export", root, str(tmp_path / "a"), "--format", "dcp", "--step", "1")
    assert code != 0 and "tensor 'packed/bits': --format dcp cannot hold dtype bits8; export with --format torch" in err
    code, _, err = run(capsys, "export", root, str(tmp_path / "b"), "--format", "torch")
    assert code != 0 and "tensor 'packed/q': --format torch cannot hold dtype uint4; no export format can hold it" in err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing written, no scratch left
    assert run(capsys, "export", root, str(tmp_path / "c.pt"), "--format", "torch", "--step", "1")[0] == 0
    loaded = torch.load(str(tmp_path / "c.pt"), weights_only=True)
    assert torch.equal(loaded["packed"]["bits"].view(torch.uint8), bits.view(torch.uint8))


def test_export_memory_stays_bounded(tmp_path):
    root = str(tmp_path / "big")
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {f"w{i}": torch.randn(64 << 20 >> 2) for i in range(4)})  # 4 x 64 MiB
    script = f"""
import threading, time, sys
import torch  # before the baseline: torch's own memory is not the export's (the CLI loads it lazily)
from resilient.ckpt import main
peak = [0]
def anon():
    with open('/proc/self/status') as f:
        return int([l for l in f if l.startswith('RssAnon')][0].split()[1]) * 1024
base = anon()
stop = False
def sample():
    while not stop:
        peak[0] = max(peak[0], anon() - base); time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
code = main(['export', {root!r}, {str(tmp_path / 'out.pt')!r}, '--format', 'torch'])
stop = True; t.join()
print('PEAK', peak[0], code)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    peak, code = map(int, out.stdout.split("PEAK")[1].split())
    assert code == 0
    assert peak < 160 << 20, f"export of 256 MiB held {peak >> 20} MiB of anonymous memory"


def test_prune_keeps_the_newest(capsys, tmp_path):
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, {"x": torch.full((2,), float(step))})
    code, out, _ = run(capsys, "prune", root, "--keep", "2", "--dry-run")
    assert code == 0 and "would delete step 1" in out and "would delete step 2" in out
    assert len([n for n in os.listdir(root) if n.startswith("step-")]) == 4
    assert run(capsys, "prune", root, "--keep", "1")[0] == 0
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000000004"]
    assert run(capsys, "prune", root, "--keep", "0")[0] == 2


def test_bad_paths_and_steps_are_one_line_errors(capsys, local_root, tmp_path):
    code, _, err = run(capsys, "ls", str(tmp_path / "nope"))
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err
    code, _, err = run(capsys, "show", local_root, "--step", "99")
    assert code == 1 and err.count("\n") == 1 and "step 99" in err and "have: 1, 2, 3" in err
    code, _, err = run(capsys, "export", local_root, str(tmp_path / "x"), "--format", "torch", "--key", "nokey")
    assert code == 1 and "'nokey'" in err
    with pytest.raises(SystemExit) as exc:
        main(["ls", local_root, "--storage-options", "{not json"])
    assert exc.value.code == 2
    proc = subprocess.run([sys.executable, "-m", "resilient.ckpt", "verify", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_python_dash_m_works_like_the_script(local_root):
    proc = subprocess.run([sys.executable, "-m", "resilient.ckpt", "ls", local_root, "--json"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0 and [r["step"] for r in json.loads(proc.stdout)] == [1, 2, 3]


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path):
    # `resilient-ckpt show ROOT | head`: the reader closes its end before the listing is
    # done; the command stops as a filter does (SIGPIPE's status), with nothing on stderr
    root = str(tmp_path / "ckpt")
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {f"layer{i:04d}": torch.zeros(2) for i in range(5000)})
    proc = subprocess.Popen([sys.executable, "-m", "resilient.ckpt", "show", root], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"step 1: 5000 tensors")
    proc.stdout.close()  # ~270 kB of rows, four pipe buffers, are still to come
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == ""


def test_push_pull_and_every_command_on_s3(capsys, local_root, tmp_path, s3_server, monkeypatch):
    url = f"s3://{s3_server['bucket']}/{uuid.uuid4().hex}"
    opts = json.dumps(s3_server["options"])
    code, _, err = run(capsys, "push", local_root, url, "--storage-options", opts)
    assert code == 0 and err.count("verified") == 3
    assert s3_server["options"]["secret"] not in err
    code, out, _ = run(capsys, "ls", url, "--json", "--storage-options", opts)
    rows = json.loads(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["tiers"] == ["s3"]
    assert run(capsys, "verify", url, "--all", "--storage-options", opts)[0] == 0
    assert json.loads(run(capsys, "show", url, "--json", "--storage-options", opts)[1])["step"] == 3
    assert run(capsys, "diff", url, "2", "3", "--storage-options", opts)[0] == 0
    assert run(capsys, "export", url, str(tmp_path / "s3.pt"), "--format", "torch", "--storage-options", opts)[0] == 0
    # pull into an empty local root, then the engine restores from it
    empty = str(tmp_path / "replaced-node")
    code, _, _ = run(capsys, "pull", url, empty, "--step", "2", "--storage-options", opts)
    assert code == 0
    state = make_state(0)
    with Checkpointer(empty) as ckpt:
        assert ckpt.restore(state) == 2
    assert state["meta"]["epoch"] == 2
    assert run(capsys, "prune", url, "--keep", "1", "--storage-options", opts)[0] == 0
    assert [r["step"] for r in json.loads(run(capsys, "ls", url, "--json", "--storage-options", opts)[1])] == [3]
    code, _, err = run(capsys, "show", url, "--step", "7", "--storage-options", opts)
    assert code == 1 and "step 7" in err


def test_a_store_that_refuses_is_a_one_line_error_naming_the_url_and_the_bucket(capsys, s3_server, tmp_path):
    opts = s3_server["options"]
    code, _, err = run(capsys, "ls", "s3://no-such-bucket-here/run", "--storage-options", json.dumps(opts))
    assert code == 1 and err.count("\n") == 1 and "the bucket 'no-such-bucket-here' does not exist" in err, err
    # no credentials anywhere (botocore's NoCredentialsError is no OSError): an error about
    # that store, not a traceback
    anonymous = {k: v for k, v in opts.items() if k not in ("key", "secret")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {"HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "resilient.ckpt", "ls", f"s3://{s3_server['bucket']}/run",
                           "--storage-options", json.dumps(anonymous)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"resilient-ckpt: error: s3://{s3_server['bucket']}/run: NoCredentialsError"), \
        proc.stderr


def test_inspecting_commands_do_not_import_torch(local_root, tmp_path):
    """ls, show, verify, timeline, push and prune read JSON and checksums only: the command
    starts in a fraction of a second instead of paying torch's import (2 s of CPU here).
    diff and export compare or write tensors, so they load torch, and only then."""
    copy, log = str(tmp_path / "copy"), str(tmp_path / "events.jsonl")
    with Checkpointer(str(tmp_path / "logged"), events=log) as ckpt:
        ckpt.save(1, make_state(1))
    script = f"""
import sys, json
from resilient.ckpt import main
import resilient
assert resilient.KeepLast and resilient.CheckpointCorruptError
codes = {{}}
for argv in (['ls', {local_root!r}], ['show', {local_root!r}, '--json'], ['verify', {local_root!r}, '--all'],
             ['timeline', {log!r}], ['push', {local_root!r}, {copy!r}, '--step', '2'],
             ['prune', {copy!r}, '--keep', '1', '--dry-run']):
    codes[argv[0]] = main(argv)
print('AFTER-INSPECTING', json.dumps(codes), 'torch' in sys.modules)
codes['diff'] = main(['diff', {local_root!r}, '1', '2'])
print('AFTER-DIFF', codes['diff'], 'torch' in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line.split(maxsplit=1)[1] for line in out.stdout.splitlines() if line.startswith("AFTER-")}
    codes_json, torch_loaded = lines["AFTER-INSPECTING"].rsplit(" ", 1)
    assert json.loads(codes_json) == {"ls": 0, "show": 0, "verify": 0, "timeline": 0, "push": 0, "prune": 0}
    assert torch_loaded == "False", "an inspecting command imported torch"
    assert lines["AFTER-DIFF"] == "0 True"


def test_a_rollbacks_first_save_names_the_abandoned_steps_and_prune_after_deletes_them(capsys, tmp_path, caplog):
    """After restore(step=2) of a run that reached step 4, the newest step wins every
    restart: the first save says so, naming the steps, and ``prune --after`` removes them.
    A fresh run saving into an old run's root is told the same."""
    root = str(tmp_path / "ckpt")
    with Checkpointer(root, keep=None) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, {"x": torch.full((2,), float(step))})
    state = {"x": torch.zeros(2)}
    with Checkpointer(root, keep=None) as ckpt:
        assert ckpt.restore(state, step=2) == 2
        caplog.clear()
        ckpt.save(3, state)  # the diverged run's own step 3 is replaced; step 4 stays newer
        assert (f"saving step 3 into {root}, which holds newer checkpoints (steps 4): another run's, or the steps a "
                "rollback abandoned. A restart resumes from the newest, step 4") in caplog.text
        assert f"resilient-ckpt prune {root} --after 2" in caplog.text
        caplog.clear()
        ckpt.save(4, state)
        assert "newer checkpoints" not in caplog.text  # said once, at the first save
    code, out, _ = run(capsys, "prune", root, "--after", "4", "--dry-run")
    assert code == 0 and "0 checkpoint(s) to delete, 4 kept (newest consistent: 4)" in out
    code, out, _ = run(capsys, "prune", root, "--after", "2")
    assert code == 0 and "deleted step 3" in out and "deleted step 4" in out
    assert "2 kept (newest consistent: 2)" in out
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000000001", "step-0000000002"]
    assert run(capsys, "prune", root, "--keep", "1", "--after", "1")[0] == 2  # one of the two
    assert run(capsys, "prune", root)[0] == 2
    caplog.clear()
    with Checkpointer(root, keep=None) as ckpt:  # a new run that did not restore
        ckpt.save(1, {"x": torch.ones(2)})
    assert "(steps 2)" in caplog.text and f"prune {root} --after 0" in caplog.text
