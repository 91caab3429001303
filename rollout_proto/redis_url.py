"""Redis Cluster URLs: ``redis+cluster://[user:password@]host:port[,host:port...]/`` (and
``rediss+cluster://`` for TLS). Any listed node serves as a seed: the client asks it for
the cluster's slot map and talks to every master itself.

Shared by the gateway (``rollout_gateway.store``, ``rollout_gateway.registry``) and the
learner (``learner_client.store``, by-reference pulls), which read the same URL and may
not import each other (``rollout_proto`` holds what both programs share).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

__all__ = ["CLUSTER_SCHEMES", "ClusterTarget", "is_cluster_url", "parse_cluster_url"]

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


@dataclass(frozen=True)
class ClusterTarget:
    """The seed nodes and connection options of a cluster URL."""

    nodes: list[tuple[str, int]]
    ssl: bool = False
    username: str | None = None
    password: str | None = None
    #: the URL's query parameters (the caller picks its own options out)
    query: dict[str, str] = field(default_factory=dict)

    def client_kwargs(self) -> dict[str, object]:
        kw: dict[str, object] = {"ssl": self.ssl}
        if self.username:
            kw["username"] = self.username
        if self.password:
            kw["password"] = self.password
        return kw


def parse_cluster_url(url: str) -> ClusterTarget:
    """ValueError for anything but ``redis+cluster://h:p[,h:p...]`` with a path of ``/``
    or nothing (a cluster has one database)."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"not a Redis Cluster URL (redis+cluster://host:port,...): {url!r}")
    auth, _, hosts = parts.netloc.rpartition("@")
    user, _, password = auth.partition(":") if auth else ("", "", "")
    nodes = []
    for hp in hosts.split(","):
        host, sep, port = hp.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"Redis Cluster URL {url!r}: each node must be host:port, "
                             f"got {hp!r}")
        nodes.append((host.strip("[]"), int(port)))
    if parts.path not in ("", "/"):
        raise ValueError(f"Redis Cluster URL {url!r} has a path (a database number?): a "
                         "cluster has only database 0")
    return ClusterTarget(nodes, ssl=parts.scheme == "rediss+cluster",
                         username=unquote(user) or None,
                         password=unquote(password) or None,
                         query=dict(parse_qsl(parts.query)))
