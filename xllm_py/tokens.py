"""The cluster token: the shared secret every cluster RPC and every prefill/decode call
carries (cluster/security.py, pd/). Read from --cluster_token_file, --cluster_token or
the XLLM_CLUSTER_TOKEN environment variable."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

logger = logging.getLogger(__name__)
TOKEN_ENV = "XLLM_CLUSTER_TOKEN"


def read_token(token: str | None, token_file: str | None) -> str | None:
    if token_file is not None:
        where = f"--cluster_token_file={token_file}"
        token = read_file("cluster_token_file", token_file).decode("utf-8", "replace").strip()
        _warn_if_others_read(token_file)
    elif token is not None:
        where = "--cluster_token"
    else:
        where, token = TOKEN_ENV, os.environ.get(TOKEN_ENV)
        if token is None:
            return None
    if not token:
        raise ValueError(f"{where}: the token is empty")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ValueError(f"{where}: the token must be printable ASCII without spaces")
    return token


def read_file(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--{flag}={path}: cannot read it ({e.strerror or e})") from None


def _warn_if_others_read(path: str) -> None:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o004:  # group-readable is fine (Kubernetes' fsGroup, a service's group)
        logger.warning(
            "--cluster_token_file=%s is readable by every user (mode %04o); chmod 600 it",
            path,
            mode,
        )
