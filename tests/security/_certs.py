"""Test PKI made in the test (the ``cryptography`` package): a CA, a server certificate
for localhost / 127.0.0.1 and a client certificate, all signed by the CA."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _issue(subject: str, key, ca_name: x509.Name, ca_key, *, ca: bool = False,
           sans: list | None = None, usage=None) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(ca_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5))
         .not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(ca_key, hashes.SHA256())


def make_pki(d: Path) -> Pki:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("rollout-gateway test CA")
    ca = _issue("rollout-gateway test CA", ca_key, ca_name, ca_key, ca=True)
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv = _issue("localhost", srv_key, ca_name, ca_key,
                 sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
                 usage=ExtendedKeyUsageOID.SERVER_AUTH)
    cli_key = ec.generate_private_key(ec.SECP256R1())
    cli = _issue("learner", cli_key, ca_name, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    pem = serialization.Encoding.PEM
    out = Pki(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")
    out.ca.write_bytes(ca.public_bytes(pem))
    out.server_cert.write_bytes(srv.public_bytes(pem))
    out.server_key.write_bytes(_pem_key(srv_key))
    out.client_cert.write_bytes(cli.public_bytes(pem))
    out.client_key.write_bytes(_pem_key(cli_key))
    return out
