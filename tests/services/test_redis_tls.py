"""``rediss://`` against a real TLS Redis: Debian's redis-server 7.0 on a TLS-only port, with a
certificate authority and server certificate made here (``cryptography``). The bus works over it
(consumer group, blocking read, the Lua commit), a real `tether scorer` scores over it and stops
at the run's end, and a client that does not trust the CA, or speaks TLS to a plain port, is
refused by the preflight with the fix."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from common.bus.client import Bus
from common.bus.consumer import Consumer
from common.bus.settings import BusSettings
from common.config.load import load_config
from common.ports import free_port
from common.protocol import streams
from common.service import run_end
from common.service.preflight import PreflightError, preflight
from tests.procs.scorer_proc import ScorerProc, make_group, scored
from tests.waiting import wait_until

PASSWORD = "tls-test-password"


def _redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    if os.environ.get("TETHER_TEST_REQUIRE_REDIS7") == "1":
        pytest.fail("TETHER_TEST_REQUIRE_REDIS7=1 but redis-server is not installed")
    pytest.skip("redis-server (Debian's Redis 7.0, built with TLS) is not installed")


def _make_certs(folder: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate it signs for 127.0.0.1 and localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tether test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),  # fmt: skip
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tether-redis")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )  # fmt: skip
    )
    paths[2].chmod(0o600)
    return paths


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """redis-server with TLS only (``--port 0``) and a password; yields (port, CA path)."""
    folder = tmp_path_factory.mktemp("tls")
    ca, cert, key = _make_certs(folder)
    port = free_port()
    args = [_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
            "--requirepass", PASSWORD, "--save", "", "--appendonly", "no",
            "--dir", str(folder), "--logfile", str(folder / "redis.log")]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                Bus(BusSettings(url=_url(port, ca), socket_timeout_s=5), service="t").ping()
                break
            except Exception:  # noqa: BLE001 - not listening yet
                assert proc.poll() is None, (folder / "redis.log").read_text()[-2000:]
                time.sleep(0.1)
        yield port, ca
    finally:
        proc.terminate()
        proc.wait(10)


def _url(port: int, ca: Path | None) -> str:
    query = f"?ssl_ca_certs={ca}" if ca else ""
    return f"rediss://:{PASSWORD}@127.0.0.1:{port}/0{query}"


def test_the_bus_works_over_tls(tls_redis):
    port, ca = tls_redis
    settings = BusSettings(url=_url(port, ca), run=f"tls{uuid.uuid4().hex[:6]}", block_ms=300,
                           socket_timeout_s=5)  # fmt: skip
    bus = Bus(settings, service="test")
    consumer = Consumer(bus, streams.GROUPS, streams.SCORERS, "c0")
    assert consumer.read(1, 300) == []  # a blocking read over TLS times out cleanly
    bus.publish(streams.GROUPS, make_group("g0", ["\\boxed{1}"], "1"))
    (d,) = consumer.read(1, 1000)
    assert d.msg.group_id == "g0"
    # the Lua commit (EVALSHA, SCRIPT LOAD) publishes downstream and acks, once
    assert consumer.commit([d], publish=[(streams.SCORED, d.msg)], dedupe_ids=["g0"]) == 1
    assert consumer.commit([d], publish=[(streams.SCORED, d.msg)], dedupe_ids=["g0"]) == 0
    assert bus.backlog(streams.GROUPS, streams.SCORERS) == (0, 0)


def test_a_scorer_scores_over_tls_and_stops_at_the_runs_end(tls_redis, tmp_path):
    port, ca = tls_redis
    run = f"tls{uuid.uuid4().hex[:6]}"
    bus = Bus(BusSettings(url=_url(port, ca), run=run, socket_timeout_s=5), service="test")
    bus.publish(streams.GROUPS, make_group("g0", ["\\boxed{0.5}", "\\boxed{2}"], "1/2"))
    p = ScorerProc(_url(port, ca), run, "scorer-0", tmp_path, "run.num_cycles=3")
    try:
        deadline = time.monotonic() + 90
        while not scored(bus) and time.monotonic() < deadline:
            assert p.proc.poll() is None, p.tail()
            time.sleep(0.2)
        (m,) = scored(bus)
        assert m.rewards == [1.0, 0.0]
        run_end.mark_finished(bus, num_cycles=3, version=3)
        assert p.proc.wait(30) == 0, p.tail()
    finally:
        p.cleanup()


def _preflight_error(url: str, tmp_path: Path) -> str:
    cfg = load_config(overrides=[f"run.redis_url={url}"], flags={}, env={}).config
    with pytest.raises(PreflightError) as err:
        preflight(cfg, "scorer")
    return str(err.value)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_an_untrusted_certificate_or_a_plain_port_is_refused_with_the_fix(tls_redis, tmp_path):
    port, _ = tls_redis
    said = _preflight_error(_url(port, None), tmp_path)  # the CA not named: not trusted
    assert "certificate is not trusted" in said and "ssl_ca_certs=" in said, said
    assert PASSWORD not in said
    plain = subprocess.Popen([_redis_server(), "--port", str(plain_port := free_port()),
                              "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_until(lambda: _accepts(plain_port), timeout_s=10, what="the plain server's port")
        said = _preflight_error(f"rediss://127.0.0.1:{plain_port}/0", tmp_path)
        assert "does not speak TLS" in said and "redis://" in said, said
    finally:
        plain.terminate()
        plain.wait(10)
