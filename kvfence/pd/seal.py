"""The cluster secret and the sealed transfer plane (I10, I11).

Every PD process of a cluster holds one secret (from a file or the environment, never the
command line). Nothing derived from it in a way that reveals it crosses the network:

- the control-plane credential, HKDF(secret, "kvfence v1 control-plane credential"), is what
  the router (or `kvfence drain`) presents on every /internal/* call (constant-time compared
  by the node);
- the key that seals one handoff's transfer rows, HKDF(secret, salt, "kv rows" | prefill
  boot id | request id | tenant), is computed by prefill and by decode on their own; the
  salt is random per hold and travels in the manifest (it is not secret), and so does the
  sealing secret's key id, HKDF(secret, "secret id"), 8 bytes that name it without revealing it.

Rotation: a process sends and seals with its one secret and also accepts credentials and rows
of the secrets it is given with --accept-cluster-secret-file; a node picks the secret a
manifest's key id names. So a cluster moves to a new secret without stopping: every process
first accepts it, then sends with it (accepting the old), then drops the old (docs/pd.md).
A process holds its secrets in a Keyring, which SIGHUP reads again from the same files: the
three steps are three edits of the files and a SIGHUP each, no restart.

Rows are sealed with AES-256-GCM (the `cryptography` package). Measured on this machine,
one core, 368,704-byte rows: 8.6 GB/s sealing, 9.3 GB/s opening, against ~1.3 GB/s for
Mooncake over loopback TCP; ChaCha20-Poly1305 does 3.3 GB/s, so GCM wins wherever the CPU
has AES instructions (ChaCha20 would be the pick on CPUs without them). A key seals one
hold's rows only, so the 96-bit nonce is simply the page index. The associated data is the
page's header (request, tenant, prefill boot id, row epoch, page index, page count, tokens
in the page), built from the manifest on both sides and never stored: a row of another
request, tenant, epoch or boot fails authentication, and the registered memory holds
nothing but ciphertext and tags.
"""
from __future__ import annotations

import functools
import hmac
import os
import stat
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SECRET_ENV = "KVFENCE_CLUSTER_SECRET"
SECRET_FILE_ENV = "KVFENCE_CLUSTER_SECRET_FILE"
MIN_SECRET_BYTES = 32
TAG_BYTES = 16
SALT_BYTES = 16
CONTROL_HEADER = "x-kvfence-cluster-token"


class SecretError(ValueError):
    """No usable cluster secret; the message says how to provide one."""


class SealError(ValueError):
    """A transfer row failed authentication."""


def load_secret(path: str | None = None, env: Mapping[str, str] | None = None) -> bytes:
    """The cluster secret: the file `path` (or $KVFENCE_CLUSTER_SECRET_FILE), else
    $KVFENCE_CLUSTER_SECRET. At least 32 bytes; surrounding whitespace is ignored."""
    env_: Mapping[str, str] = os.environ if env is None else env
    path = path or env_.get(SECRET_FILE_ENV) or None
    if path:
        try:
            with open(path, "rb") as f:      # the mode and owner of the file read, not of a name swapped after
                st = os.fstat(f.fileno())
                raw = f.read().strip()
        except OSError as e:
            raise SecretError(f"cannot read the cluster secret file {path}: {e.strerror}") from None
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (os.geteuid(), 0):
            raise SecretError(f"the cluster secret file {path} belongs to user {st.st_uid}, not to the user kvfence "
                              f"runs as ({os.geteuid()}) or root: its owner can swap it; `chown` it to this user")
        if mode & 0o026:   # others may read, or group or others may write: it has leaked, or can be swapped
            raise SecretError(f"the cluster secret file {path} has mode {mode:o}: other users may read or change "
                              f"it, so it cannot be trusted to seal KV rows; run `chmod 600 {path}` (0400 or "
                              "0440 are fine too), and make a new secret if others could read this one")
        where = f"the cluster secret file {path}"
    elif env_.get(SECRET_ENV):
        raw = env_[SECRET_ENV].strip().encode()
        where = f"${SECRET_ENV}"
    else:
        raise SecretError(
            "a PD node or router needs the cluster secret: put at least 32 random bytes in a file readable only "
            f"by kvfence and pass --cluster-secret-file FILE (or set ${SECRET_FILE_ENV}, or ${SECRET_ENV}); "
            "e.g. `kvfence secret new cluster.secret`. "
            "`kvfence launch-pd` makes one for its own processes")
    if len(raw) < MIN_SECRET_BYTES:
        raise SecretError(f"{where} holds {len(raw)} bytes; the cluster secret needs at least {MIN_SECRET_BYTES}")
    return raw


def new_secret() -> str:
    """A fresh random secret, as text for a file (what launch-pd writes)."""
    return os.urandom(32).hex()


def _hkdf(secret: bytes, info: bytes, salt: bytes | None = None, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(secret)


def _field(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<I", len(b)) + b   # length-prefixed: no two identities encode alike


# derived once per secret: every internal request checks the credential against each secret a
# node holds, and every handoff looks its key id up (the secrets are in this process anyway)
@functools.lru_cache(maxsize=32)
def control_token(secret: bytes) -> str:
    """The credential the router presents on the nodes' internal routes."""
    return _hkdf(secret, b"kvfence v1 control-plane credential").hex()


def control_headers(secret: bytes) -> dict[str, str]:
    return {CONTROL_HEADER: control_token(secret)}


def check_control(secret: bytes, presented: str | None, accepted: Sequence[bytes] = ()) -> bool:
    """Constant-time comparison of a presented credential with this process's secret's and
    those of the secrets it accepts during a rotation (each compared, none skipped)."""
    given = (presented or "").encode()
    return sum(hmac.compare_digest(given, control_token(s).encode()) for s in (secret, *accepted)) > 0


@functools.lru_cache(maxsize=32)
def key_id(secret: bytes) -> str:
    """Names a secret in a manifest (which one sealed the rows) without revealing it."""
    return _hkdf(secret, b"kvfence v1 secret id", length=8).hex()


def secret_for_key(key: str, secret: bytes, accepted: Sequence[bytes] = ()) -> bytes | None:
    """The secret among this process's own and its accepted ones that `key` names, or None."""
    return next((s for s in (secret, *accepted) if hmac.compare_digest(key_id(s), key)), None)


MAX_ACCEPTED = 8   # a rotation needs one; a node's info lists at most 16 key ids


@dataclass(frozen=True)
class SecretSet:
    """The secrets a process holds at one moment: the one it sends its credential with and
    seals its rows with, then those it also accepts while the cluster rotates (each once, its
    own not among them: an accepted file holding the process's own secret is how the last
    step of a rotation by reload drops the old one)."""
    own: bytes = field(repr=False)
    accepted: tuple[bytes, ...] = field(default=(), repr=False)

    def __repr__(self) -> str:   # key ids only: a set in a log line or a traceback reveals nothing
        return f"SecretSet(key_ids={self.key_ids})"

    def __post_init__(self) -> None:
        distinct: list[bytes] = []
        for s in self.accepted:
            if s != self.own and s not in distinct:
                distinct.append(s)
        if len(distinct) > MAX_ACCEPTED:
            raise SecretError(f"{len(distinct)} secrets accepted besides the process's own; at most {MAX_ACCEPTED}")
        object.__setattr__(self, "accepted", tuple(distinct))

    @property
    def key_ids(self) -> list[str]:
        """The key id of the secret it seals with first, then those it accepts."""
        return [key_id(s) for s in (self.own, *self.accepted)]

    def accepts(self, presented: str | None) -> bool:
        return check_control(self.own, presented, self.accepted)

    def for_key(self, key: str) -> bytes | None:
        return secret_for_key(key, self.own, self.accepted)


def describe_secrets(s: SecretSet) -> str:
    """For the log: the key ids, never the secrets."""
    own, *accepted = s.key_ids
    return f"cluster secret key id {own}" + (f"; also accepts {', '.join(accepted)}" if accepted else "")


class Keyring:
    """The secrets a PD process holds now. `reload` reads them again from where they were read
    at start (the secret file or the environment, and each accepted file) and swaps the whole
    set at once: a reader sees the old set or the new one, never half of each. A reload where
    any file fails load_secret's checks changes nothing. A keyring made from secrets alone
    (tests, the simulation) has nothing to reload."""

    def __init__(self, secrets: SecretSet, own_file: str | None = None, accept_files: Sequence[str] = (),
                 reloadable: bool = False):
        self.current = secrets
        self.own_file = own_file
        self.accept_files = tuple(accept_files)
        self.reloadable = reloadable
        self._lock = threading.Lock()   # one reload at a time (SIGHUPs in a row)

    @classmethod
    def load(cls, own_file: str | None, accept_files: Sequence[str] = ()) -> Keyring:
        """From the files (own_file None: $KVFENCE_CLUSTER_SECRET_FILE or $KVFENCE_CLUSTER_SECRET);
        raises SecretError saying what is wrong."""
        return cls(cls._read(own_file, accept_files), own_file, accept_files, reloadable=True)

    @staticmethod
    def _read(own_file: str | None, accept_files: Sequence[str]) -> SecretSet:
        own = load_secret(own_file)
        accepted = []
        for path in accept_files:
            try:
                accepted.append(load_secret(path))
            except SecretError as e:
                raise SecretError(f"--accept-cluster-secret-file: {e}") from None
        return SecretSet(own, tuple(accepted))

    def reload(self) -> tuple[SecretSet, SecretSet]:
        """(before, after); raises SecretError (nothing changed) if a file does not load."""
        if not self.reloadable:
            raise SecretError("this process's secrets were not read from files; there is nothing to reload")
        with self._lock:
            before, after = self.current, self._read(self.own_file, self.accept_files)
            self.current = after
        return before, after


def new_salt() -> str:
    return os.urandom(SALT_BYTES).hex()


def _nonce(index: int) -> bytes:
    return struct.pack("<I", index) + bytes(8)


class RowCipher:
    """Seals and opens the rows of one hold (one request's handoff from one prefill boot)."""

    def __init__(self, secret: bytes, salt_hex: str, boot_id: str, request_id: str, tenant: str):
        info = b"kvfence v1 kv rows" + _field(boot_id) + _field(request_id) + _field(tenant)
        self._key = _hkdf(secret, info, salt=bytes.fromhex(salt_hex))
        self._aead = AESGCM(self._key)

    def seal_into(self, index: int, plaintext, aad: bytes, out) -> None:
        """Write ciphertext || tag of page `index` into `out` (len(plaintext) + 16 bytes)."""
        self._aead.encrypt_into(_nonce(index), plaintext, aad, out)

    def open_into(self, index: int, sealed: bytes, aad: bytes, out) -> None:
        """Authenticate and decrypt page `index` into `out`, or raise SealError (then `out`
        holds nothing usable). `sealed` must be a private copy: the bytes authenticated are
        the bytes decrypted."""
        try:
            self._aead.decrypt_into(_nonce(index), sealed, aad, out)
        except InvalidTag:
            raise SealError(f"page {index}: authentication failed (a row of another request, tenant, epoch or "
                            f"prefill process, or bytes changed in transit)") from None

    def open_unauthenticated_into(self, index: int, sealed: bytes, out) -> None:
        """Fault injection only (skip_row_auth): GCM's decryption without its tag check,
        i.e. AES-CTR from counter 2, so tests can show what the authentication stops."""
        ctr = Cipher(algorithms.AES(self._key), modes.CTR(_nonce(index) + struct.pack(">I", 2))).decryptor()
        ctr.update_into(sealed[:-TAG_BYTES], out)
        ctr.finalize()
