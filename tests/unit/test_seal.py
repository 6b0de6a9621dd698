"""The cluster secret, the control credential and the sealed rows (kvfence/pd/seal.py)."""
from __future__ import annotations

import os

import pytest

from kvfence.pd.seal import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    TAG_BYTES,
    Keyring,
    RowCipher,
    SealError,
    SecretError,
    SecretSet,
    check_control,
    control_token,
    key_id,
    load_secret,
    new_salt,
    new_secret,
    secret_for_key,
)

SECRET = b"k" * 40


def test_secret_from_file_then_env(tmp_path):
    f = tmp_path / "s"
    f.write_text(new_secret() + "\n")
    f.chmod(0o600)
    assert load_secret(str(f), env={}) == f.read_text().strip().encode()
    assert load_secret(env={SECRET_FILE_ENV: str(f)}) == f.read_text().strip().encode()
    assert load_secret(env={SECRET_ENV: "x" * 32}) == b"x" * 32


def test_missing_or_short_secret_says_how_to_fix():
    with pytest.raises(SecretError, match="--cluster-secret-file"):
        load_secret(env={})
    with pytest.raises(SecretError, match="at least 32"):
        load_secret(env={SECRET_ENV: "short"})
    with pytest.raises(SecretError, match="cannot read"):
        load_secret("/nonexistent/secret", env={})


def test_control_credential():
    tok = control_token(SECRET)
    assert check_control(SECRET, tok) and not check_control(SECRET, None) and not check_control(SECRET, tok[:-1])
    assert not check_control(b"o" * 40, tok)
    assert SECRET.hex() not in tok and SECRET.decode() not in tok   # the secret itself never crosses


def test_during_a_rotation_a_node_accepts_the_credentials_of_its_accepted_secrets_only():
    new, other = b"n" * 40, b"o" * 40
    assert check_control(SECRET, control_token(new), accepted=(new,))
    assert check_control(SECRET, control_token(SECRET), accepted=(new,))
    assert not check_control(SECRET, control_token(new)) and not check_control(SECRET, control_token(other), (new,))
    assert not check_control(SECRET, None, accepted=(new,))


def test_a_key_id_names_a_secret_without_revealing_it():
    new = b"n" * 40
    assert key_id(SECRET) == key_id(SECRET) != key_id(new) and len(key_id(SECRET)) == 16
    assert key_id(SECRET) not in control_token(SECRET) and SECRET.hex()[:16] != key_id(SECRET)
    assert secret_for_key(key_id(new), SECRET, (new,)) == new
    assert secret_for_key(key_id(SECRET), SECRET, (new,)) == SECRET
    assert secret_for_key(key_id(new), SECRET) is None and secret_for_key("0" * 16, SECRET, (new,)) is None


def _file(path, text: str, mode: int = 0o600) -> str:
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


def test_accepted_secret_files_are_held_to_the_same_checks(tmp_path):
    good = _file(tmp_path / "good", new_secret())
    loose = _file(tmp_path / "loose", new_secret(), 0o644)
    own = _file(tmp_path / "own", new_secret())
    ring = Keyring.load(own, [good])
    assert ring.current.accepted == (open(good, "rb").read().strip(),) and Keyring.load(own).current.accepted == ()
    with pytest.raises(SecretError, match="--accept-cluster-secret-file: .*chmod 600"):
        Keyring.load(own, [good, loose])


def test_a_secret_set_holds_each_secret_once_its_own_first():
    """An accepted file holding the process's own secret is how the last step of a rotation by
    reload drops the old one: the set then accepts nothing besides its own."""
    new = b"n" * 40
    s = SecretSet(SECRET, (SECRET, new, new))
    assert s.accepted == (new,) and s.key_ids == [key_id(SECRET), key_id(new)]
    assert SecretSet(SECRET, (SECRET,)).accepted == () and SecretSet(SECRET, (SECRET,)).key_ids == [key_id(SECRET)]
    assert s.accepts(control_token(new)) and not SecretSet(SECRET, (SECRET,)).accepts(control_token(new))
    assert s.for_key(key_id(new)) == new and SecretSet(SECRET).for_key(key_id(new)) is None
    assert SECRET.decode() not in repr(s) and SECRET.hex() not in repr(s) and key_id(new) in repr(s)
    with pytest.raises(SecretError, match="at most 8"):
        SecretSet(SECRET, tuple(bytes([65 + i]) * 40 for i in range(9)))


def test_a_keyring_rotates_by_reloading_its_files(tmp_path):
    """The three steps of docs/pd.md as edits of the same two files, each read by reload():
    accept NEW; send with NEW accepting OLD; NEW alone. A reload where a file fails its checks
    keeps the previous set whole."""
    old, new = new_secret(), new_secret()
    own, accept = tmp_path / "own", tmp_path / "accept"
    ring = Keyring.load(_file(own, old), [_file(accept, old)])
    assert ring.current == SecretSet(old.encode())
    _file(accept, new)
    before, after = ring.reload()
    assert before == SecretSet(old.encode()) and ring.current == after == SecretSet(old.encode(), (new.encode(),))
    _file(own, new)
    _file(accept, old)
    ring.reload()
    assert ring.current.own == new.encode() and ring.current.accepts(control_token(old.encode()))
    _file(accept, "short")
    with pytest.raises(SecretError, match="at least 32"):
        ring.reload()
    assert ring.current == SecretSet(new.encode(), (old.encode(),))   # unchanged
    _file(accept, new)
    ring.reload()
    assert ring.current == SecretSet(new.encode()) and not ring.current.accepts(control_token(old.encode()))
    with pytest.raises(SecretError, match="nothing to reload"):
        Keyring(SecretSet(SECRET)).reload()


def seal(cipher: RowCipher, index: int, plain: bytes, aad: bytes) -> bytearray:
    out = bytearray(len(plain) + TAG_BYTES)
    cipher.seal_into(index, plain, aad, out)
    return out


def open_(cipher: RowCipher, index: int, sealed: bytes, aad: bytes) -> bytes:
    out = bytearray(len(sealed) - TAG_BYTES)
    cipher.open_into(index, bytes(sealed), aad, out)
    return bytes(out)


def test_round_trip_and_every_binding():
    """The key is bound to secret, salt, prefill boot, request and tenant; the nonce to the
    page index; the header to the associated data. Changing any one fails authentication
    (a key not bound to the request is the mutant the second case catches)."""
    salt = new_salt()
    plain, aad = os.urandom(4096), b"header-of-page-0"
    c = RowCipher(SECRET, salt, "boot", "req", "acme")
    sealed = seal(c, 0, plain, aad)
    assert open_(c, 0, sealed, aad) == plain and bytes(sealed[:len(plain)]) != plain
    others = [RowCipher(SECRET, salt, "boot", "req2", "acme"), RowCipher(SECRET, salt, "boot", "req", "globex"),
              RowCipher(SECRET, salt, "boot2", "req", "acme"), RowCipher(SECRET, new_salt(), "boot", "req", "acme"),
              RowCipher(b"o" * 40, salt, "boot", "req", "acme")]
    for other in others:
        with pytest.raises(SealError, match="authentication failed"):
            open_(other, 0, sealed, aad)
    with pytest.raises(SealError):
        open_(c, 1, sealed, aad)                  # another page index
    with pytest.raises(SealError):
        open_(c, 0, sealed, b"header-of-page-1")  # another header (epoch, tokens, ...)
    tampered = bytearray(sealed)
    tampered[100] ^= 1
    with pytest.raises(SealError):
        open_(c, 0, tampered, aad)


def test_identity_fields_cannot_be_shifted_into_each_other():
    """Length-prefixed fields: ("ab", "c") and ("a", "bc") are different keys."""
    salt, plain = new_salt(), b"p" * 64
    sealed = seal(RowCipher(SECRET, salt, "boot", "ab", "c"), 0, plain, b"")
    with pytest.raises(SealError):
        open_(RowCipher(SECRET, salt, "boot", "a", "bc"), 0, sealed, b"")


def test_unauthenticated_open_is_plain_ctr():
    """The skip_row_auth fault decrypts like GCM without the tag check: same plaintext for an
    untouched row, a flipped plaintext byte for a flipped ciphertext byte."""
    c = RowCipher(SECRET, new_salt(), "boot", "req", "acme")
    plain = os.urandom(1000)
    sealed = seal(c, 3, plain, b"aad")
    out = bytearray(len(plain))
    c.open_unauthenticated_into(3, bytes(sealed), out)
    assert bytes(out) == plain
    sealed[10] ^= 0x40
    c.open_unauthenticated_into(3, bytes(sealed), out)
    assert out[10] == plain[10] ^ 0x40 and bytes(out[11:]) == plain[11:]


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620, 0o602, 0o666])
def test_a_secret_file_others_can_read_or_anyone_can_write_is_refused(tmp_path, mode):
    # the secret seals every KV row and opens every node's internal API: a file others can
    # read has leaked it already (ssh refuses such key files for the same reason)
    f = tmp_path / "s"
    f.write_text(new_secret() + "\n")
    f.chmod(mode)
    with pytest.raises(SecretError, match="chmod 600") as e:
        load_secret(str(f), env={})
    assert oct(mode)[2:] in str(e.value) and f.read_text().strip() not in str(e.value)


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o440, 0o640])
def test_owner_and_group_readable_secret_files_load(tmp_path, mode):
    # 0400 is what the Kubernetes manifests mount; 0440/0640 what a pod's fsGroup gives
    f = tmp_path / "s"
    f.write_text(new_secret() + "\n")
    f.chmod(mode)
    assert len(load_secret(str(f), env={})) >= 32


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_secret_file_another_user_owns_is_refused(tmp_path):
    # found in review: its owner can swap the secret whatever the mode says
    f = tmp_path / "s"
    f.write_text(new_secret() + "\n")
    f.chmod(0o600)
    os.chown(f, 12345, 0)
    with pytest.raises(SecretError, match="belongs to user 12345"):
        load_secret(str(f), env={})
    os.chown(f, 0, 0)
    assert len(load_secret(str(f), env={})) >= 32
