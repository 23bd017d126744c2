import logging
import os
import tempfile

import pytest


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "ckpt")


@pytest.fixture(autouse=True)
def _resilient_logs(caplog):
    caplog.set_level(logging.INFO, logger="resilient")


@pytest.fixture(autouse=True)
def _no_gang_leaks():
    """An in-process rendezvous exports RESILIENT_GANG (for its workers); it must not make
    a later test's Checkpointer believe it runs in that (long closed) round."""
    yield
    os.environ.pop("RESILIENT_GANG", None)


@pytest.fixture(scope="session", autouse=True)
def _children_write_temporary_files_under_the_tests_root(tmp_path_factory):
    """Processes the tests start (agents, workers, examples) make their temporary files in
    this session's pytest directory, not in /tmp: torch's agent alone left a
    ``torchelastic_*`` log directory there for every run of ``resilient-run``, 230 after
    three runs of the suite. pytest keeps its last three session directories."""
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # this process's own too: it read TMPDIR once, at its first use


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server (moto's server mode) on 127.0.0.1, as s3fs's own tests use."""
    pytest.importorskip("s3fs")
    from resilient.devservices import S3Server

    server = S3Server(bucket="ckpt-tests").start()
    yield {"endpoint": server.endpoint, "options": server.storage_options, "bucket": server.bucket}
    server.stop()


@pytest.fixture(scope="session")
def etcd_server():
    """A real etcd (v3 API) on 127.0.0.1 for the whole session."""
    from resilient.devservices import EtcdServer

    server = EtcdServer().start()
    yield server
    server.close()


@pytest.fixture
def cluster(tmp_path, etcd_server, request):
    """Simulated nodes (one resilient-run agent each) for one run id; all killed afterwards."""
    from .nodes import Cluster

    c = Cluster(str(tmp_path), etcd_server.endpoint, run_id=f"{request.node.name}-{os.getpid()}")
    # a resumed run trains 30 more steps: enough for what any test checks after a recovery
    # (steps >= restored + 10), without the tail of a run sized to outlast its faults (5-10 s a test)
    c.steps_after_resume = 30
    yield c
    c.close()
