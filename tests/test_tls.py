"""Mutual TLS between brokers: certificates generated for the test, refused strangers."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvbroker.client import RoomState, SenderRef
from kvbroker.v1 import admin_pb2, admin_pb2_grpc

from .conftest import page_bytes


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _ca(tmp: Path, tag: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"kvbroker test CA {tag}"))
        .issuer_name(_name(f"kvbroker test CA {tag}"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = tmp / f"ca-{tag}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


#: What a leaf certificate names unless told otherwise: this machine's loopback.
LOOPBACK_SANS: tuple[x509.GeneralName, ...] = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))


def _leaf(
    tmp: Path,
    name: str,
    ca_key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    sans: Sequence[x509.GeneralName] = LOOPBACK_SANS,
) -> tuple[Path, Path]:
    """A certificate (and its key) for ``name``, signed by ``ca``, whose SubjectAlternativeName is ``sans``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(list(sans)),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = tmp / f"{name}.pem", tmp / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture
def pki(short_tmp: Path) -> dict[str, Path]:
    ca_key, ca, ca_path = _ca(short_tmp, "good")
    rogue_key, rogue, rogue_path = _ca(short_tmp, "rogue")
    files = {"ca": ca_path, "rogue_ca": rogue_path}
    for name in ("p", "d", "operator"):
        files[f"{name}_cert"], files[f"{name}_key"] = _leaf(short_tmp, name, ca_key, ca)
    files["rogue_cert"], files["rogue_key"] = _leaf(short_tmp, "rogue", rogue_key, rogue)
    return files


def _tls(pki: dict[str, Path], name: str) -> dict[str, object]:
    return {"tls_cert_file": str(pki[f"{name}_cert"]), "tls_key_file": str(pki[f"{name}_key"]), "tls_ca_file": str(pki["ca"])}


def _stats(address: str, credentials: grpc.ChannelCredentials | None) -> admin_pb2.Stats:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        return admin_pb2_grpc.AdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=5)


def _creds(pki: dict[str, Path], cert: str, ca: str = "ca") -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pki[ca].read_bytes(),
        private_key=pki[f"{cert}_key"].read_bytes(),
        certificate_chain=pki[f"{cert}_cert"].read_bytes(),
    )


def test_rooms_move_between_brokers_with_mutual_tls(fake_brokers, make_engine, pki) -> None:
    """Two brokers with mutual TLS handshake and move a room; engines use the unix socket."""
    p, d = fake_brokers("p", **_tls(pki, "p")), fake_brokers("d", **_tls(pki, "d"))
    pe = make_engine(f"unix:{p.broker.endpoints.engine_socket_path}", "prefill")
    de = make_engine(f"unix:{d.broker.endpoints.engine_socket_path}", "decode")
    src, dst = np.array([1, 2, 3], dtype=np.int32), np.array([7, 8, 9], dtype=np.int32)
    de.handle.receiver(1, SenderRef(p.address, "prefill-group")).init(dst, aux_row=0)
    sender = pe.handle.sender(1)
    sender.init(3, aux_row=1)
    sender.send(src)
    assert de.handle.wait([1], timeout_seconds=10)[1].state == RoomState.SUCCESS
    for layer in range(2):
        for a, b in zip(page_bytes(pe.memory, layer, src), page_bytes(de.memory, layer, dst)):
            assert torch.equal(a, b)
    assert _stats(p.address, _creds(pki, "operator")).peers == 1


def test_unauthenticated_clients_are_refused(fake_brokers, pki) -> None:
    """Without a client certificate, or with one from another CA, the TCP port refuses the call."""
    b = fake_brokers("b", **_tls(pki, "p"))
    with pytest.raises(grpc.RpcError) as plain:
        _stats(b.address, None)
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    no_cert = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
    with pytest.raises(grpc.RpcError) as anonymous:
        _stats(b.address, no_cert)
    assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as stranger:
        _stats(b.address, _creds(pki, "rogue"))
    assert stranger.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _stats(b.address, _creds(pki, "operator")).broker_id == b.broker.broker_id


def test_a_peer_without_the_right_certificate_cannot_handshake(fake_brokers, make_engine, pki) -> None:
    """A decode broker whose certificate another CA signed cannot reach a TLS prefill broker: its room fails."""
    p = fake_brokers("p", **_tls(pki, "p"))
    rogue = {"tls_cert_file": str(pki["rogue_cert"]), "tls_key_file": str(pki["rogue_key"]), "tls_ca_file": str(pki["ca"])}
    d = fake_brokers("d", bootstrap_timeout_seconds=0.5, peer_rpc_timeout_seconds=0.5, **rogue)
    de = make_engine(f"unix:{d.broker.endpoints.engine_socket_path}", "decode")
    de.handle.receiver(2, SenderRef(p.address, "prefill-group")).init([1], aux_row=0)
    status = de.handle.wait([2], timeout_seconds=10)[2]
    assert status.state == RoomState.FAILED and "handshake" in status.cause.message
