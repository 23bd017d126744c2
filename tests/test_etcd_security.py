"""etcd as production runs it: TLS with client certificates (a CA made here with openssl)
and etcd's own authentication. The agent, its watches and the workers' fencing client all
work through them; a TLS or credential problem is an error that says so at once."""

import json
import os
import subprocess
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from resilient.devservices import EtcdServer, etcd_binary
from resilient.launch._etcd import PASSWORD_ENV, USER_ENV, EtcdSecurityError
from resilient.launch.gang import GANG_ENV, Gang
from resilient.launch.rendezvous import create_handler

from .test_rendezvous import rendezvous_all

pytestmark = pytest.mark.timeout(90)


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: str, name: str) -> dict[str, str]:
    """A CA and one certificate it signs, valid for 127.0.0.1 as server and as client."""
    os.makedirs(d, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", f"/CN={name} test CA", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr",
             "-subj", "/CN=127.0.0.1", cwd=d)
    with open(os.path.join(d, "ext.cnf"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return {"cacert": os.path.join(d, "ca.pem"), "cert": os.path.join(d, "node.pem"), "key": os.path.join(d, "node.key")}


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    pki = make_pki(os.path.join(d, "good"), "good")
    server = EtcdServer(tls=pki).start()
    yield server, pki, make_pki(os.path.join(d, "other"), "other")
    server.close()  # stop() alone left its data directory (~120 MB) in /tmp


def _params(endpoint: str, run_id: str, **conf) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, local_addr="127.0.0.1", lease_ttl=3,
                                last_call_timeout=2, **conf)


def test_rendezvous_and_fencing_over_tls_with_client_certificates(tls_etcd, monkeypatch):
    server, pki, _ = tls_etcd
    handlers = [create_handler(_params(server.endpoint, "tls-run", **pki)) for _ in range(2)]
    try:
        infos = rendezvous_all(handlers)  # joins, the closer's watches, leases: all over TLS
        assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
        gang = json.loads(os.environ[GANG_ENV])
        assert gang["tls"] == {"protocol": "https", **pki} and "password" not in json.dumps(gang)
        Gang.from_info(gang).authorize_commit(7)  # the workers' fencing client, from what they inherit
    finally:
        for h in handlers:
            h.shutdown()


@pytest.mark.parametrize("case", ["no client certificate", "another CA"])
def test_tls_problems_are_errors_that_say_so(tls_etcd, case):
    server, pki, other = tls_etcd
    conf = {"cacert": pki["cacert"]} if case == "no client certificate" else other
    started = time.monotonic()
    with pytest.raises(EtcdSecurityError, match="TLS with etcd at https://127.0.0.1"):
        create_handler(_params(server.endpoint, f"bad-{case}", **conf)).next_rendezvous()
    assert time.monotonic() - started < 15  # not an endless "unreachable" retry
    with pytest.raises(EtcdSecurityError, match="cert=.*key="):
        create_handler(_params(server.endpoint, "half", cacert=pki["cacert"], cert=pki["cert"]))
    # the certificate of one client with the key of another: said at once, naming the files
    with pytest.raises(EtcdSecurityError, match=f"key={other['key']}: cannot be loaded"):
        create_handler(_params(server.endpoint, "mismatch", cacert=pki["cacert"], cert=pki["cert"], key=other["key"]))


def test_etcd_authentication_from_the_environment(tmp_path, monkeypatch):
    server = EtcdServer(data_dir=str(tmp_path / "etcd")).start()
    try:
        ctl = os.path.join(os.path.dirname(etcd_binary()), "etcdctl")
        env = {**os.environ, "ETCDCTL_API": "3"}
        for args in (["user", "add", "root:s3cret-pw"], ["auth", "enable"]):
            subprocess.run([ctl, "--endpoints", server.endpoint, *args], check=True, capture_output=True,
                           env=env, timeout=30)
        monkeypatch.delenv(USER_ENV, raising=False)
        monkeypatch.delenv(PASSWORD_ENV, raising=False)
        with pytest.raises(EtcdSecurityError, match=f"requires authentication: set {USER_ENV}"):
            create_handler(_params(server.endpoint, "auth-run")).next_rendezvous()
        monkeypatch.setenv(USER_ENV, "root")
        monkeypatch.setenv(PASSWORD_ENV, "wrong")
        with pytest.raises(EtcdSecurityError, match="refused user 'root'") as refused:
            create_handler(_params(server.endpoint, "auth-run"))
        assert "wrong" not in str(refused.value)  # the password never appears in an error
        monkeypatch.setenv(PASSWORD_ENV, "s3cret-pw")
        handlers = [create_handler(_params(server.endpoint, "auth-run")) for _ in range(2)]
        try:
            assert sorted(i.rank for i in rendezvous_all(handlers)) == [0, 1]
            gang = json.loads(os.environ[GANG_ENV])
            assert "s3cret-pw" not in json.dumps(gang)
            Gang.from_info(gang).authorize_commit(3)
        finally:
            for h in handlers:
                h.shutdown()
    finally:
        server.stop()
