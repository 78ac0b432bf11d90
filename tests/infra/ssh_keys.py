"""Public keys for the config tests: real ones from ssh-keygen, and broken ones built from them.

The private halves were never kept; these keys open nothing.
"""

from __future__ import annotations

import base64
import struct

ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICHiciy4XhgASnQLNQu9REA9Z4xd+o87DSNsT2dz3c2m ops@example.com"
RSA_2048 = (
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQDlj5O5dPt7Mw+Z9ZVlGPmPP/nNF+j1cCVPu/wgYNbgu2ee4rlZEAMiYWj9I75cP07B1i3SFGFLF"
    "YzFHQ/fks6AKVNAIdjgGsgyiJEsCw6dz7nlEHGLT0RkgNxc+qtS8+RU/H9fRkrHdrtyZ//sHgwjVtSw/I9HuUyjvf9RwQB1kY1dwOMlo1pqSIbP1f"
    "5VZ0TwmiEVzEZ9Ihky0h39TN3uVTexnHJa14lY2EsUZ3gUYjyFSiVJfToR3kvGWjAOlOPWNK1r/7KzxqP8Y5uZpntHkkIDXgX6GpoFR3Z3tkSz13m"
    "LJix0jbttM25XCMRAvDQp5m2S6tUNa5R4MMBiiIzD ops@example.com"
)
RSA_1024 = (
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQDAcsJzsZWBZEVv3w/64shj6/NUnEdYA8le67fcRDnHRaCvWu88VTQ4MZAJHf8F2ztmtM/AXd2Q"
    "nFG8tXFARSJ5pwiIathh3axUxsEsQGdqORHsg8P1U7d64Gt9wOxbk47e/5TtzypCbHpH/Mr4651goBy6VHb8DpADKJvAeh0LMQ=="
    " old@example.com"
)
ECDSA_P256 = (
    "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBO5AStfr9+gMQUo2ZOvftiBM/t3ykUePWfVFanlMdw"
    "N2UBSCfihn4KquK/1wSt/bH7KWhJJ/HeQmKIrc7GoHCZk= ec@example.com"
)


def blob(key: str) -> bytes:
    """The decoded key data of a valid key."""
    return base64.b64decode(key.split()[1])


def wire(*fields: bytes) -> bytes:
    """SSH wire format: each field as a 4-byte big-endian length and its bytes."""
    return b"".join(struct.pack(">I", len(field)) + field for field in fields)


def make_key(word: str, data: bytes, comment: str = "ops@example.com") -> str:
    return f"{word} {base64.b64encode(data).decode()} {comment}"


def rsa_with(exponent: int, modulus: int) -> str:
    def mpint(n: int) -> bytes:
        return n.to_bytes(n.bit_length() // 8 + 1, "big")  # a leading zero byte keeps it positive

    return make_key("ssh-rsa", wire(b"ssh-rsa", mpint(exponent), mpint(modulus)))
