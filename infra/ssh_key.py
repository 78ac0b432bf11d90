"""OpenSSH public keys, checked by parsing their wire format with the standard library.

Azure takes ssh-rsa keys of at least 2048 bits and ssh-ed25519 keys, and nothing else (no
ECDSA, no DSA, no security keys). A key that passes here is one Azure and sshd will read: one
key, valid base64, its embedded type the same as its type word, every length field consistent.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Callable

MIN_RSA_BITS = 2048  # Azure refuses shorter RSA keys
ED25519_KEY_BYTES = 32
# Type words OpenSSH writes; a second one in a value means a second key pasted after the first.
OPENSSH_KEY_TYPES = frozenset(
    {
        "ssh-rsa",
        "ssh-ed25519",
        "ssh-dss",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "sk-ssh-ed25519@openssh.com",
        "sk-ecdsa-sha2-nistp256@openssh.com",
    }
)


class SshKeyError(ValueError):
    """Says what is wrong with a public key, in words for the person who pasted it."""


def check_public_key(text: str) -> str:
    """Return the key stripped of surrounding whitespace, or raise SshKeyError."""
    value = text.strip()
    if "\n" in value or "\r" in value:
        raise SshKeyError("spans several lines; give exactly one public key")
    word, *rest = value.split() or [""]
    if word not in KEY_CHECKS:
        raise SshKeyError(f"must be an OpenSSH public key of type {' or '.join(KEY_CHECKS)}; Azure refuses other types")
    if not rest:
        raise SshKeyError("has no key data after its type")
    blob_text, *comment = rest
    if any(token in OPENSSH_KEY_TYPES for token in comment):
        raise SshKeyError("holds more than one key; give exactly one public key")
    fields = _wire_strings(_decode(blob_text))
    if fields[0] != word.encode():
        embedded = fields[0][:40].decode(errors="replace")
        raise SshKeyError(f"says {word} but its key data holds a {embedded!r} key")
    KEY_CHECKS[word](fields[1:])
    return value


def _decode(blob_text: str) -> bytes:
    try:
        return base64.b64decode(blob_text, validate=True)
    except binascii.Error:
        raise SshKeyError("has key data that is not valid base64 (corrupted or cut short)") from None


def _wire_strings(blob: bytes) -> list[bytes]:
    """Split an SSH wire-format blob into its length-prefixed strings (RFC 4251, section 5)."""
    fields: list[bytes] = []
    offset = 0
    while offset < len(blob):
        if offset + 4 > len(blob):
            raise SshKeyError("has key data that is cut short or corrupted (a length field is incomplete)")
        (length,) = struct.unpack_from(">I", blob, offset)
        offset += 4
        if offset + length > len(blob):
            raise SshKeyError("has key data that is cut short or corrupted (a field runs past its end)")
        fields.append(blob[offset : offset + length])
        offset += length
    if not fields:
        raise SshKeyError("has no key data")
    return fields


def _field_count(fields: list[bytes], expected: int, key_type: str) -> None:
    if len(fields) != expected:
        raise SshKeyError(f"is not a well-formed {key_type} key: {len(fields)} fields after its type, not {expected}")


def _check_rsa(fields: list[bytes]) -> None:
    _field_count(fields, 2, "ssh-rsa")
    exponent, modulus = (int.from_bytes(field, "big") for field in fields)
    if exponent < 3 or exponent % 2 == 0 or modulus % 2 == 0:
        raise SshKeyError("is not a valid RSA key: its exponent or modulus is malformed")
    if modulus.bit_length() < MIN_RSA_BITS:
        raise SshKeyError(f"is a {modulus.bit_length()}-bit RSA key; Azure requires at least {MIN_RSA_BITS} bits")


def _check_ed25519(fields: list[bytes]) -> None:
    _field_count(fields, 1, "ssh-ed25519")
    if len(fields[0]) != ED25519_KEY_BYTES:
        raise SshKeyError(f"holds a {len(fields[0])}-byte ed25519 key; an ed25519 key is {ED25519_KEY_BYTES} bytes")


KEY_CHECKS: dict[str, Callable[[list[bytes]], None]] = {"ssh-rsa": _check_rsa, "ssh-ed25519": _check_ed25519}
