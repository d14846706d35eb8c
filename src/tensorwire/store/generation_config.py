"""How many generations a server keeps and how much state its peers may make it hold for
generations (``GenerationConfig``; store/generations.py, server/generation_ops.py and
server/generation_parts.py enforce it), and the ``tensorwire serve`` flag that sets each bound
(``FLAGS``), which every refusal names."""

from __future__ import annotations

from dataclasses import dataclass, fields

DEFAULT_KEEP = 2
DEFAULT_MAX_LEASE_SECONDS = 60.0
DEFAULT_MAX_PREFIXES = 1024
DEFAULT_PREFIXES_PER_CLIENT = 256
DEFAULT_LEASES_PER_OWNER = 64
DEFAULT_LEASES_PER_CLIENT = 1024
DEFAULT_MAX_WAITERS = 4096
DEFAULT_WAITERS_PER_OWNER = 64
DEFAULT_WAITERS_PER_CLIENT = 1024
DEFAULT_MAX_WAIT_SECONDS = 300.0
DEFAULT_MAX_TRANSACTIONS = 64
DEFAULT_TRANSACTIONS_PER_OWNER = 8
DEFAULT_TRANSACTIONS_PER_CLIENT = 16
DEFAULT_MAX_PARTS = 4096
# Prefixes the server publishes itself: a parameter server's relay pulls (``_ps/<job>``,
# ps/server/relay.py). No client publishes under it: the job's workers trust what it holds.
SERVER_PREFIX = "_ps"


def is_server_prefix(prefix: str) -> bool:
    """Whether ``prefix`` is, or lies under, the server's own (``SERVER_PREFIX``)."""
    return prefix == SERVER_PREFIX or prefix.startswith(SERVER_PREFIX + "/")


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """How many generations a server keeps and how much state peers may make it hold. "Owner": one
    connection (over gRPC, one calling peer); "client": a client host (every connection from it)."""

    keep: int = DEFAULT_KEEP  # the last this many generations of each prefix
    max_lease_seconds: float = DEFAULT_MAX_LEASE_SECONDS  # a longer lease is granted this long
    max_prefixes: int = DEFAULT_MAX_PREFIXES  # prefixes with generations, server-wide
    prefixes_per_client: int = DEFAULT_PREFIXES_PER_CLIENT  # ... made by one client host
    leases_per_owner: int = DEFAULT_LEASES_PER_OWNER  # leases one connection holds at once
    leases_per_client: int = DEFAULT_LEASES_PER_CLIENT  # ... one client host
    max_waiters: int = DEFAULT_MAX_WAITERS  # GEN_WAIT requests parked, server-wide
    waiters_per_owner: int = DEFAULT_WAITERS_PER_OWNER  # ... on one connection
    waiters_per_client: int = DEFAULT_WAITERS_PER_CLIENT  # ... from one client host
    max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS  # a longer wait is answered at this point
    # multi-part publishes (GEN_PUBLISH_PART): open at once server-wide, with a part from one
    # connection, from one client host, and parts in one; each waits at most max_wait_seconds
    max_transactions: int = DEFAULT_MAX_TRANSACTIONS
    transactions_per_owner: int = DEFAULT_TRANSACTIONS_PER_OWNER
    transactions_per_client: int = DEFAULT_TRANSACTIONS_PER_CLIENT
    max_parts: int = DEFAULT_MAX_PARTS

    def __post_init__(self) -> None:
        counts = [getattr(self, f.name) for f in fields(self) if f.type == "int"]
        if min(counts) < 1 or self.max_lease_seconds <= 0 or self.max_wait_seconds <= 0:
            raise ValueError(f"generation limits must be positive: {self}")

    def most(self, name: str) -> str:
        """``at most N (--flag)`` for the bound ``name``: what every refusal says."""
        return f"at most {getattr(self, name)} ({FLAGS[name]})"


# The ``tensorwire serve`` flag that sets each bound (cli/serve.py; a test checks they exist).
FLAGS = {
    "keep": "--keep-generations",
    "max_lease_seconds": "--max-lease-seconds",
    "max_prefixes": "--max-prefixes",
    "prefixes_per_client": "--prefixes-per-client",
    "leases_per_owner": "--leases-per-connection",
    "leases_per_client": "--leases-per-client",
    "max_waiters": "--max-waiters",
    "waiters_per_owner": "--waiters-per-connection",
    "waiters_per_client": "--waiters-per-client",
    "max_wait_seconds": "--max-wait-seconds",
    "max_transactions": "--max-transactions",
    "transactions_per_owner": "--transactions-per-connection",
    "transactions_per_client": "--transactions-per-client",
    "max_parts": "--max-parts",
}
