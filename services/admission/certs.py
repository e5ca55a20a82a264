"""Self-signed CA and serving certificate for running the webhook without a cluster's cert machinery."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class ServingPair:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path) -> tuple[Path, Path, Path]:
        """ca.crt, tls.crt and tls.key (0600) in `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        ca, cert, key = directory / "ca.crt", directory / "tls.crt", directory / "tls.key"
        ca.write_bytes(self.ca_pem)
        cert.write_bytes(self.cert_pem)
        key.touch(mode=0o600)
        key.write_bytes(self.key_pem)
        return ca, cert, key


def _usage(**enabled: bool) -> x509.KeyUsage:
    names = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
             "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{n: enabled.get(n, False) for n in names})


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def issue(hosts: list[str], *, days: int = 30, ca_name: str = "kai-isolator dev CA") -> ServingPair:
    """A fresh EC P-256 CA and a serving certificate for `hosts` (DNS names or IP literals)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return ServingPair(
        ca_pem=ca_cert.public_bytes(pem),
        cert_pem=cert.public_bytes(pem),
        key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
