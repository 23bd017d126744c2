"""resilient-run's command line: torchrun's parser, with the script's options left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from resilient.launch.run import parse

from .launch import REPO

pytestmark = pytest.mark.timeout(120)


def test_torchrun_flags_in_both_spellings_and_script_options_untouched():
    args = parse(["--nnodes=1:3", "--nproc_per_node", "2", "--rdzv-backend", "etcd-v3",
                  "--rdzv_endpoint=h:2379", "--max-restarts=2", "train.py", "--log", "x", "--nnodes", "7"])
    assert args.nnodes == "1:3" and args.nproc_per_node == "2" and args.rdzv_backend == "etcd-v3"
    assert args.rdzv_endpoint == "h:2379" and args.max_restarts == 2
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--log", "x", "--nnodes", "7"]


def test_module_mode_no_python_and_double_dash():
    args = parse(["--standalone", "-m", "pkg.train", "--lr", "3"])
    assert args.module and args.standalone and args.training_script == "pkg.train"
    assert args.training_script_args == ["--lr", "3"]
    args = parse(["--no-python", "--", "echo", "--max-restarts=9"])
    assert args.no_python and args.training_script == "echo" and args.training_script_args == ["--max-restarts=9"]


def test_pet_environment_variables(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_NNODES", "2:4")
    args = parse(["train.py"])
    assert args.nproc_per_node == "3" and args.nnodes == "2:4"


def test_unknown_launcher_flag_before_the_script_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse(["--bogus-flag", "train.py"])
    assert "--bogus-flag" in capsys.readouterr().err


def test_a_missing_training_script_is_refused_before_any_rendezvous(tmp_path):
    # with an etcd endpoint nobody serves: the refusal comes before the agent would wait on it
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "resilient.launch.run", "--nnodes=2", "--rdzv-backend=etcd-v3",
         "--rdzv-endpoint=127.0.0.1:1", str(tmp_path / "trian.py"), "--lr", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 2 and time.monotonic() - started < 30
    assert f"training script '{tmp_path / 'trian.py'}' is not a file" in result.stderr
    assert "Traceback" not in result.stderr and "rendezvous" not in result.stderr


def test_standalone_two_workers_get_torchruns_environment(tmp_path):
    script = tmp_path / "show_env.py"
    out = tmp_path / "env"
    script.write_text(
        "import json, os, sys\n"
        "keys = ['RANK','LOCAL_RANK','WORLD_SIZE','GROUP_RANK','LOCAL_WORLD_SIZE','MASTER_ADDR','MASTER_PORT',"
        "'TORCHELASTIC_RUN_ID','TORCHELASTIC_RESTART_COUNT']\n"
        "open(sys.argv[2] + os.environ['RANK'], 'w').write(json.dumps({k: os.environ.get(k) for k in keys} | "
        "{'argv': sys.argv[1:]}))\n")
    result = subprocess.run(
        [sys.executable, "-m", "resilient.launch.run", "--standalone", "--nproc-per-node=2", str(script),
         "--log", str(out)], cwd=REPO, capture_output=True, text=True, timeout=100,
        env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [json.loads((tmp_path / f"env{r}").read_text()) for r in (0, 1)]
    assert [s["RANK"] for s in seen] == ["0", "1"] and {s["WORLD_SIZE"] for s in seen} == {"2"}
    assert all(s[k] is not None for s in seen for k in s), seen
    assert seen[0]["argv"] == ["--log", str(out)]
    # the one-word switch from torchrun adds no noise: in-process recovery's trust note is for
    # jobs that recover in-process (tests/test_inprocess.py)
    assert "in-process recovery" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("body, code, printed", [
    ("return 3", 3, ""),
    ("return None", 0, ""),
    ("sys.exit('bad flag --x')", 1, "bad flag --x"),
    ("raise RuntimeError('boom')", 1, "RuntimeError: boom"),
    ("raise KeyboardInterrupt", 130, "KeyboardInterrupt"),
])
def test_commands_exit_with_the_status_the_interpreter_would_give_after_exit_handlers(body, code, printed):
    """The commands skip the interpreter's teardown (resilient/_exit.py): the status, the
    message, exit handlers and buffered output must be what a normal exit gives."""
    script = (
        "import atexit, importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('exit_', {os.path.join(REPO, 'resilient', '_exit.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "atexit.register(lambda: print('exit handler ran'))\n"
        "def command():\n"
        "    print('buffered line', end='')\n"
        f"    {body}\n"
        "mod.run_and_exit(command)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == code, out
    assert out.stdout.startswith("buffered line") and "exit handler ran" in out.stdout
    assert printed in out.stderr
