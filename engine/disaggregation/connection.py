"""How a leader and its decode process reach each other: the address (HOST:PORT, EngineConfig's
disaggregation decode_address) and the shared key of their `multiprocessing.connection`. Both
ends import it: RemoteDecodePool (decode_pool.py) connects, the decode process
(decode_process.py) listens.
"""

from __future__ import annotations

import os

AUTHKEY_ENV = "JAXSERVE_POOL_AUTHKEY"  # shared secret of the two processes (default: a constant)


def authkey() -> bytes:
    return os.environ.get(AUTHKEY_ENV, "jaxserve-decode-pool").encode()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"EngineConfig.disaggregation.decode_address must be HOST:PORT, got {address!r}")
    return host, int(port)
