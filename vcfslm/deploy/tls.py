"""The deployment's certificates: a CA of its own and the certificates it signs for the
front door and each node's proxy, or the operator's certificate for the door (pure: PEM
text in, PEM text out; the files are keys.py's and service.py's).

Keys are ECDSA P-256 (fast to make and to handshake on a CPU that serves a model). A
server certificate names its IP address(es) as subjectAltName, which is what a client
checks; it is issued again when it no longer covers its address or is near its end.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVER_DAYS = 397                      # what public CAs may issue; renewed by serve up
RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key, PEM."""

    cert: str
    key: str = field(repr=False)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_ca(name: str, now: dt.datetime | None = None) -> Pair:
    """A CA for one deployment: it signs the door's and the proxies' certificates, nothing else
    (path length 0)."""
    now = now or _now()
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"vcfslm {name} deployment CA")])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return Pair(cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key))


def issue(ca: Pair, hosts: Sequence[str], now: dt.datetime | None = None) -> Pair:
    """A server certificate for `hosts` (IP addresses or names), signed by `ca`."""
    if not hosts:
        raise ValueError("a server certificate needs at least one address")
    now = now or _now()
    ca_cert = x509.load_pem_x509_certificate(ca.cert.encode())
    ca_key = serialization.load_pem_private_key(ca.key.encode(), password=None)
    key = _new_key()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Pair(cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key))


def covered_hosts(cert_pem: str) -> set[str]:
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in san.get_values_for_type(x509.IPAddress)} | set(san.get_values_for_type(x509.DNSName))


def problems(pair: Pair, hosts: Sequence[str], ca_cert: str | None = None,
             now: dt.datetime | None = None, renew_before: dt.timedelta = dt.timedelta(0)) -> list[str]:
    """Why `pair` cannot serve `hosts` (empty: it can): unreadable, its key not its
    certificate's, not yet or no longer valid (or within `renew_before` of its end), an
    address it does not name, or (with `ca_cert`) not signed by that CA."""
    now = now or _now()
    try:
        cert = x509.load_pem_x509_certificate(pair.cert.encode())
    except ValueError as exc:
        return [f"not a PEM certificate ({exc})"]
    try:
        key = serialization.load_pem_private_key(pair.key.encode(), password=None)
    except (ValueError, TypeError) as exc:
        return [f"its private key is not an unencrypted PEM key ({exc})"]
    out = []
    if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        out.append("the private key does not belong to the certificate")
    if cert.not_valid_before_utc > now:
        out.append(f"not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")
    if cert.not_valid_after_utc <= now + renew_before:
        out.append(f"expires {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    missing = [h for h in hosts if h not in covered_hosts(pair.cert)]
    if missing:
        out.append(f"does not name {', '.join(missing)} (subjectAltName)")
    if ca_cert is not None:
        ca = x509.load_pem_x509_certificate(ca_cert.encode())
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            out.append("not signed by the deployment's CA")
    return out


def current_or_new(ca: Pair, held: Pair | None, hosts: Sequence[str], now: dt.datetime | None = None) -> Pair:
    """The certificate kept for `hosts` while it still serves them for a month more, else a new one."""
    if held is not None and not problems(held, hosts, ca.cert, now, RENEW_BEFORE):
        return held
    return issue(ca, hosts, now)
