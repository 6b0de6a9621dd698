"""A throwaway CA, server certificates for given IP addresses and a client certificate, made
with the `cryptography` package, for the TLS tests."""
from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert: x509.Certificate) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".crt")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def make_pki(directory: Path, server_ips: list[str], server_names: tuple[str, ...] = ()) -> dict[str, str]:
    """ca, server_cert/server_key (for server_ips and server_names), client_cert/client_key,
    fleet_cert/fleet_key (both uses, for server_ips and server_names), other_ca (an unrelated CA)."""
    now = dt.datetime.now(dt.UTC)
    out: dict[str, str] = {}

    def ca(cn: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(cn: str, ca_key, ca_cert, ips: list[str], usage, names: tuple[str, ...] = ()):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usage if isinstance(usage, list) else [usage]), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
        if ips or names:
            sans = [x509.IPAddress(ipaddress.ip_address(i)) for i in ips] + [x509.DNSName(n) for n in names]
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, b.sign(ca_key, hashes.SHA256())

    ca_key, ca_cert = ca("kvfence test CA")
    out["ca"], _ = _write(directory / "ca", ca_key, ca_cert)
    k, c = leaf("kvfence node", ca_key, ca_cert, server_ips, ExtendedKeyUsageOID.SERVER_AUTH, server_names)
    out["server_cert"], out["server_key"] = _write(directory / "server", k, c)
    k, c = leaf("kvfence router", ca_key, ca_cert, [], ExtendedKeyUsageOID.CLIENT_AUTH)
    out["client_cert"], out["client_key"] = _write(directory / "client", k, c)
    # one certificate for both ends, as the Kubernetes manifests' fleet uses (deploy/kubernetes/secrets.yaml)
    k, c = leaf("kvfence fleet", ca_key, ca_cert, server_ips,
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], server_names)
    out["fleet_cert"], out["fleet_key"] = _write(directory / "fleet", k, c)
    other_key, other_cert = ca("some other CA")
    out["other_ca"], _ = _write(directory / "other-ca", other_key, other_cert)
    k, c = leaf("intruder", other_key, other_cert, [], ExtendedKeyUsageOID.CLIENT_AUTH)
    out["other_client_cert"], out["other_client_key"] = _write(directory / "other-client", k, c)
    return out
