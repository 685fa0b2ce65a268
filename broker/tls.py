"""Mutual TLS for the broker's TCP port and its calls to peers (files from the config)."""

from __future__ import annotations

from pathlib import Path

import grpc

from kvbroker.broker.config import BrokerConfig

__all__ = ["channel_credentials", "server_credentials"]


def _read(path: str | None) -> bytes:
    assert path is not None
    return Path(path).read_bytes()


def server_credentials(config: BrokerConfig) -> grpc.ServerCredentials:
    """Server side: present our certificate, require a client certificate from the CA."""
    return grpc.ssl_server_credentials(
        [(_read(config.tls_key_file), _read(config.tls_cert_file))],
        root_certificates=_read(config.tls_ca_file),
        require_client_auth=True,
    )


def channel_credentials(config: BrokerConfig) -> grpc.ChannelCredentials:
    """Client side (calls to peers): trust the CA, present our certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca_file),
        private_key=_read(config.tls_key_file),
        certificate_chain=_read(config.tls_cert_file),
    )
