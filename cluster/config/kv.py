"""``kv_transfer:`` of a ``ClusterConfig``: the KV connector between prefill and decode
instances."""

from __future__ import annotations

import secrets
from functools import cached_property
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from cluster.config.base import _Config
from kv_transfer.tls import TLSMaterial

NIXL_SAFETY_MARGIN_S = 1.0  # a one-sided read ends this long before its source's lease


class KVTransferConfig(_Config):
    """The KV connector between prefill and decode instances.

    ``transport``: ``nixl`` (one-sided reads straight into the decode blocks; the
    ``tandem-serve[nixl]`` extra), ``ray`` (the object store), ``grpc`` (pulls from each
    worker's KV server), or ``auto`` (the default): ``nixl`` when it can be imported and the
    workers reach each other with it (probed when they start), else ``ray``.

    The ``grpc`` transport's knobs are ignored by ``ray``. Its cluster token, which every KV
    request carries, is ``auth_token`` or, unset, a random one made when the config is built:
    every worker started from this config shares it (copies and the pickles sent to the actors
    keep it), while two configs loaded from one file still compare equal. A ``SecretStr``:
    never in reprs, logs or dumps.
    """

    transport: Literal["auto", "nixl", "ray", "grpc"] = "auto"
    timeout_s: float = Field(5.0, gt=0.0, le=600.0, description="Deadline of one transfer.")
    failure_policy: Literal["recompute", "fail"] = "recompute"
    auth_token: SecretStr | None = Field(
        None,
        description="grpc: the cluster token KV requests carry (random per config if unset; "
        "set it when several processes build their own config for one cluster).",
    )
    lease_s: float | None = Field(
        None,
        gt=0.0,
        le=3600.0,
        description="grpc, nixl: how long a prefill worker holds a request's blocks for the pull "
        "(default: timeout_s plus a grace of max(1 s, timeout_s / 2), so that the lease "
        "outlives the decode side's deadline).",
    )
    ucx_tls: str | None = Field(
        None,
        min_length=1,
        description="nixl: the UCX transports the workers' KV reads may use (UCX_TLS), e.g. "
        "'tcp' where a same-node kernel copy (CMA) is not permitted; default: UCX's choice.",
    )
    same_node_copy: bool = Field(
        True,
        description="nixl: between two workers of one machine, copy the blocks with one "
        "kernel copy (process_vm_readv, what UCX's CMA transport does underneath) instead of a "
        "NIXL READ: the same rights, a fraction of the per-transfer cost. Used where the "
        "reader can attach to the source; never with ucx_tls set.",
    )
    bind_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="grpc: the address each worker's KV server binds (port chosen by the "
        "system); 0.0.0.0 for a cluster of several machines.",
    )
    advertise_host: str | None = Field(
        None,
        min_length=1,
        description="grpc: the address other workers reach a KV server at (default: bind_host, "
        "or this machine's address when bind_host is a wildcard).",
    )
    chunk_size_bytes: int = Field(
        1 << 20, ge=4096, le=64 << 20, description="grpc: the largest data message of a pull."
    )
    tls: bool = Field(
        False,
        description="grpc: mutual TLS between workers (KV bytes and the token encrypted; only "
        "peers with a certificate of the cluster's CA connect). With no files below, a CA and "
        "a certificate are made for the cluster when the config is built.",
    )
    tls_ca_file: str | None = Field(None, min_length=1, description="grpc: the CA (PEM).")
    tls_cert_file: str | None = Field(
        None, min_length=1, description="grpc: every worker's certificate (PEM), signed by the CA."
    )
    tls_key_file: str | None = Field(None, min_length=1, description="grpc: its key (PEM).")
    tls_server_name: str = Field(
        "tandem-kv",
        min_length=1,
        description="grpc: the DNS name in the certificate that clients check servers against "
        "(workers are reached by address; one name stands for all of them).",
    )

    @model_validator(mode="after")
    def _check(self) -> KVTransferConfig:
        token = None if self.auth_token is None else self.auth_token.get_secret_value()
        if token is not None and len(token) < 16:
            raise ValueError("kv_transfer.auth_token must be at least 16 characters")
        if token is not None and set(token) == {"*"}:
            raise ValueError(
                "kv_transfer.auth_token is a masked secret (from a dump): set the real one"
            )
        files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if any(f is not None for f in files) and None in files:
            raise ValueError(
                "kv_transfer.tls_ca_file, tls_cert_file and tls_key_file go together (or none: "
                "a CA and certificate are made for the cluster)"
            )
        if any(f is not None for f in files) and not self.tls:
            raise ValueError("kv_transfer.tls_* files are set but kv_transfer.tls is false")
        if self.transport in ("nixl", "auto") and self.effective_lease_s <= NIXL_SAFETY_MARGIN_S:
            raise ValueError(
                f"kv_transfer.lease_s ({self.effective_lease_s}) must exceed the nixl "
                f"transport's safety margin of {NIXL_SAFETY_MARGIN_S} s (transport "
                f"{self.transport})"
            )
        if self.tls and self.transport != "grpc":
            raise ValueError(
                "kv_transfer.tls is for the grpc transport; the ray transport rides Ray's own "
                "channels (encrypted only with Ray's TLS: RAY_USE_TLS=1)"
            )
        return self

    def model_post_init(self, context: Any, /) -> None:
        _ = self.cluster_token  # made now, so that every copy of this config carries it
        if self.tls and self.tls_ca_file is None:
            _ = self.cluster_tls  # likewise the generated CA and certificate

    @cached_property
    def cluster_tls(self) -> TLSMaterial | None:
        """The TLS material of the grpc transport (None without ``tls``): read from the files,
        or made for this config when it was built (kept in the instance, like the token)."""
        if not self.tls:
            return None
        if self.tls_ca_file is not None and self.tls_cert_file and self.tls_key_file:
            return TLSMaterial.from_files(
                self.tls_ca_file, self.tls_cert_file, self.tls_key_file, self.tls_server_name
            )
        return TLSMaterial.generate(self.tls_server_name)

    @cached_property
    def cluster_token(self) -> SecretStr:
        """``auth_token``, or the random token made for this config when it was built. Kept
        in the instance, not in a field: not dumped, not compared."""
        return self.auth_token or SecretStr(secrets.token_urlsafe(32))

    @property
    def effective_lease_s(self) -> float:
        """``lease_s``, or its default derived from ``timeout_s``."""
        if self.lease_s is not None:
            return self.lease_s
        return self.timeout_s + max(1.0, self.timeout_s / 2)

    @property
    def auto(self) -> bool:
        return self.transport == "auto"

    def resolved(self) -> KVTransferConfig:
        """This config with ``auto`` replaced by its first choice here: ``nixl`` when NIXL can
        be imported, else ``ray`` (whether the workers reach each other is probed when they
        start: ``cluster.control.placement.connect_kv_peers``)."""
        if not self.auto:
            return self
        from kv_transfer.nixl_package import nixl_available

        return self.with_transport("nixl" if nixl_available() else "ray")

    def with_transport(self, transport: str) -> KVTransferConfig:
        return self.model_copy(update={"transport": transport})

    def connector_options(self) -> dict[str, Any]:
        """Keyword arguments of the workers' connector for this transport."""
        if self.transport == "nixl":
            options: dict[str, Any] = {
                "lease_s": self.effective_lease_s,
                "safety_margin_s": NIXL_SAFETY_MARGIN_S,
            }
            if self.ucx_tls is not None:
                options["ucx_tls"] = self.ucx_tls
            if not self.same_node_copy:
                options["same_node_copy"] = False
            return options
        if self.transport != "grpc":
            return {}
        return {
            "auth_token": self.cluster_token,  # unwrapped by the connector only
            "lease_s": self.effective_lease_s,
            "bind_host": self.bind_host,
            "advertise_host": self.advertise_host,
            "chunk_size_bytes": self.chunk_size_bytes,
            "tls": self.cluster_tls,
        }
