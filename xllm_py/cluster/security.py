"""Who may speak on the cluster's gRPC control plane: a shared token, the master's
session, and optional (mutual) TLS.

    every RPC of both services   metadata x-xllm-cluster-token = the --cluster_token_file
                                 (or --cluster_token, or env XLLM_CLUSTER_TOKEN) token,
                                 compared in constant time by `TokenCheck`, a server
                                 interceptor: missing or wrong -> UNAUTHENTICATED before
                                 any servicer code runs, so nothing changes on the server
    Worker RPCs from the master  metadata x-xllm-session = the id the master returned in
                                 RegisterReply; a worker refuses InitModel, AllocateCache,
                                 ExecuteStep and Shutdown without it (PERMISSION_DENIED,
                                 worker_node.py)
    --cluster_tls_cert/_key      every server listens with TLS and every channel dials TLS
    --cluster_tls_ca             mutual TLS: servers require a client certificate signed by
                                 this CA, clients verify servers against it and present
                                 their own certificate. Without it, servers' certificates
                                 must chain to the system's roots and clients present none.

A node's certificate must name the address the others dial (a SAN with the IP or host of
--master_node_addr for the master, of --host for a worker). Without a token the control
plane is open to anyone who can reach its ports (one warning at start-up); without TLS
the token and the session id cross the network in clear.
"""

from __future__ import annotations

import collections
import hmac
import logging
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from xllm_py.tokens import read_file, read_token

logger = logging.getLogger(__name__)
TOKEN_KEY = "x-xllm-cluster-token"  # gRPC metadata keys are lower case
SESSION_KEY = "x-xllm-session"


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes of this node's certificate chain and key, and of the CA (None: no mTLS)."""

    cert: bytes
    key: bytes = field(repr=False)
    ca: bytes | None = None

    @property
    def mutual(self) -> bool:
        return self.ca is not None


@dataclass(frozen=True)
class ClusterSecurity:
    """The control plane's credentials: the shared token (None: open) and TLS files."""

    token: str | None = None
    tls: TlsFiles | None = None

    def __repr__(self) -> str:  # never print the token
        return f"ClusterSecurity(token={'set' if self.token else None}, tls={self.describe()})"

    def describe(self) -> str:
        if self.tls is None:
            return "plaintext"
        return "mutual TLS" if self.tls.mutual else "TLS"

    def server(self, max_workers: int = 4, options=()) -> grpc.Server:
        """A gRPC server that refuses calls without the token (when one is set)."""
        interceptors = [TokenCheck(self.token)] if self.token else []
        pool = futures.ThreadPoolExecutor(max_workers=max_workers)
        return grpc.server(pool, interceptors=interceptors, options=list(options))

    def listen(self, server: grpc.Server, address: str, flags: str) -> None:
        """Bind `server` to address (TLS when configured) or raise ValueError naming the
        flags that chose it."""
        try:
            if self.tls is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, self._server_credentials())
        except RuntimeError:
            port = 0
        if not port:
            why = "in use?"
            if self.tls is not None:
                why = "in use, or --cluster_tls_key is not the key of --cluster_tls_cert?"
            raise ValueError(f"{flags}: cannot listen on {address} ({why})")

    def channel(self, address: str, options=(), metadata=()) -> grpc.Channel:
        """A channel to `address` whose every call carries the token and `metadata`
        (pairs of lower-case key and value)."""
        if self.tls is None:
            channel = grpc.insecure_channel(address, options=list(options))
        else:
            channel = grpc.secure_channel(address, self._channel_credentials(), list(options))
        pairs = ([(TOKEN_KEY, self.token)] if self.token else []) + list(metadata)
        return grpc.intercept_channel(channel, AddMetadata(pairs)) if pairs else channel

    def _server_credentials(self) -> grpc.ServerCredentials:
        t = self.tls
        return grpc.ssl_server_credentials(
            [(t.key, t.cert)], root_certificates=t.ca, require_client_auth=t.mutual
        )

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        t = self.tls
        if not t.mutual:
            return grpc.ssl_channel_credentials()  # the system's roots verify the server
        return grpc.ssl_channel_credentials(
            root_certificates=t.ca, private_key=t.key, certificate_chain=t.cert
        )


INSECURE = ClusterSecurity()


# ---- the token on the wire ---------------------------------------------------------------


class TokenCheck(grpc.ServerInterceptor):
    """Every call must carry the cluster token; others end UNAUTHENTICATED at once."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        given = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(given.encode(), self._token):
            return continuation(details)
        return _refusal(details.method)


def _refusal(method: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call UNAUTHENTICATED (every cluster RPC is unary-unary)."""

    def refuse(request, context: grpc.ServicerContext) -> None:
        logger.warning("refused %s from %s: missing or wrong cluster token", method, context.peer())
        context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong cluster token (every node needs the same --cluster_token_file)",
        )

    return grpc.unary_unary_rpc_method_handler(refuse)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class AddMetadata(grpc.UnaryUnaryClientInterceptor):
    """Adds fixed metadata pairs to every call of a channel."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = tuple(pairs)

    def intercept_unary_unary(self, continuation, details, request):
        new = _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self.pairs),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )
        return continuation(new, request)


def metadata_value(context: grpc.ServicerContext, key: str) -> str:
    """The value of one metadata key of an incoming call ("" when absent)."""
    return dict(context.invocation_metadata() or ()).get(key, "")


def same_secret(given: str, expected: str | None) -> bool:
    """Constant-time equality; an unset or empty expected secret matches nothing."""
    return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


# ---- loading the flags -------------------------------------------------------------------


def check_flags(token, token_file, cert, key, ca) -> None:
    """The combinations of the security flags that cannot work (no file is read)."""
    if token is not None and token_file is not None:
        raise ValueError("--cluster_token and --cluster_token_file: give one of them")
    if (cert is None) != (key is None):
        raise ValueError("--cluster_tls_cert and --cluster_tls_key go together: give both")
    if ca is not None and cert is None:
        raise ValueError(
            "--cluster_tls_ca (mutual TLS) needs this node's own --cluster_tls_cert and "
            "--cluster_tls_key"
        )


def load_security(token=None, token_file=None, cert=None, key=None, ca=None) -> ClusterSecurity:
    """The flags' credentials, files read now; ValueError naming the flag on a problem.
    The token comes from --cluster_token_file, else --cluster_token, else the
    XLLM_CLUSTER_TOKEN environment variable."""
    check_flags(token, token_file, cert, key, ca)
    return ClusterSecurity(read_token(token, token_file), read_tls(cert, key, ca))


def read_tls(cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
    if cert is None:
        return None
    return TlsFiles(
        _pem("cluster_tls_cert", cert, "CERTIFICATE-----"),
        _pem("cluster_tls_key", key, "PRIVATE KEY-----"),
        None if ca is None else _pem("cluster_tls_ca", ca, "CERTIFICATE-----"),
    )


def _pem(flag: str, path: str, marker: str) -> bytes:
    data = read_file(flag, path)
    if marker.encode() not in data:
        raise ValueError(f"--{flag}={path}: not a PEM file with a '-----BEGIN ...{marker}'")
    return data


def warn_if_open(security: ClusterSecurity, role: str) -> None:
    """One line at start-up about how the control plane is protected."""
    if security.token is None:
        logger.warning(
            "%s: the cluster control plane is unauthenticated: anyone who can reach its gRPC "
            "ports can register a worker or drive steps; give every node the same "
            "--cluster_token_file",
            role,
        )
    else:
        logger.info("%s: cluster RPCs need the cluster token (%s)", role, security.describe())
