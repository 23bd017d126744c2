import logging
import os

import pytest


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "ckpt")


@pytest.fixture(autouse=True)
def _resilient_logs(caplog):
    caplog.set_level(logging.INFO, logger="resilient")


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server (moto's server mode) on 127.0.0.1, as s3fs's own tests use."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    from .launch import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    options = {"key": "testing-key-id", "secret": "testing-secret-key", "client_kwargs": {"endpoint_url": endpoint}}
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("ckpt-tests")
    yield {"endpoint": endpoint, "options": options, "bucket": "ckpt-tests"}
    server.stop()


@pytest.fixture(scope="session")
def etcd_server():
    """A real etcd (v3 API) on 127.0.0.1 for the whole session."""
    from .services import EtcdServer

    server = EtcdServer().start()
    yield server
    server.close()


@pytest.fixture
def cluster(tmp_path, etcd_server, request):
    """Simulated nodes (one resilient-run agent each) for one run id; all killed afterwards."""
    from .nodes import Cluster

    c = Cluster(str(tmp_path), etcd_server.endpoint, run_id=f"{request.node.name}-{os.getpid()}")
    yield c
    c.close()
