import logging

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
