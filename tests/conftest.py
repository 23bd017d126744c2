import logging

import pytest


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "ckpt")


@pytest.fixture(autouse=True)
def _resilient_logs(caplog):
    caplog.set_level(logging.INFO, logger="resilient")
