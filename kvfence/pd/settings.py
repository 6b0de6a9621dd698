"""Settings of a PD node (prefill or decode), and why each timeout is safe (I6).

The lease and fence arithmetic, with D = a lease's deadline (prefill's clock):

- decode starts a pull only while now < D - clock_skew_s (decode's clock), so every pull
  starts before D on prefill's clock;
- a started pull ends (completes, fails or is cut by the transfer engine's own timeout)
  within max_pull_s;
- so after D + max_pull_s + clock_skew_s no pull can be reading a held row, and prefill
  may reuse the rows of a lease that ended without an ACK (expired, aborted, decode gone)
  only then: that is the fence. An ACK, or decode saying no pull is running, lifts it
  earlier.
- decode's own rows: a pull writes only decode's transfer buffer, never pool pages; rows
  of a pull decode gave up on stay fenced until the transfer engine reports the pull over
  or max_pull_s after its start, whichever is first.

max_pull_s is long on purpose: Mooncake's first contact with a peer that accepts the
connection but never answers blocks about 60 s whatever the MC_* timeouts say (measured),
so the bound must cover it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.pd.seal import Keyring, SecretSet

ROLES = ("prefill", "decode")


@dataclass
class PDSettings:
    role: str
    transfer_host: str = "127.0.0.1"        # address the transfer engine advertises to peers
    transfer_buffer_pages: int | None = None  # rows in the transfer buffer; None: as many as the KV pool
    lease_s: float = 30.0                   # prefill holds a request's KV this long for the pull
    transfer_timeout_s: int = 5             # Mooncake's own per-transfer timeouts (MC_* variables)
    max_pull_s: float = 75.0                # upper bound on a started pull, see above
    pull_give_up_s: float = 10.0            # decode answers the client with an error after this
    clock_skew_s: float = 1.0               # largest clock difference between prefill and decode
    # decode reserves the prompt plus at most this many generated tokens before the transfer;
    # a request grows page by page past that, like on a single node (kvfence/pd/decode.py)
    decode_reserve_tokens: int = 256
    # a router process silent this long is taken for gone: its cache scopes here are retired
    # (engine/router_realms.py)
    router_scope_idle_s: float = 600.0
    # the cluster secret (kvfence/pd/seal.py): seals transfer rows, derives the control credential
    cluster_secret: bytes | None = field(default=None, repr=False)
    # secrets also accepted while the cluster rotates to a new one (credentials, sealed rows)
    accepted_secrets: tuple[bytes, ...] = field(default=(), repr=False)
    # what the node holds now: `secrets` reads it. The two fields above only make a keyring when
    # none is given, and are cleared then (a reload on SIGHUP changes the keyring alone)
    keyring: Keyring | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"PD role must be one of {', '.join(ROLES)}; got {self.role!r}")
        # each bound written so that NaN fails it: a NaN lease or skew would make every fence
        # comparison false, and a negative skew would lift fences before a pull can have ended
        for name in ("lease_s", "max_pull_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds; got {getattr(self, name)!r}")
        if not 0 <= self.clock_skew_s < float("inf"):
            raise ValueError(f"clock_skew_s must be >= 0 seconds (it widens every fence); got {self.clock_skew_s!r}")
        if not 0 < self.pull_give_up_s < float("inf"):
            raise ValueError(f"pull_give_up_s must be a positive number of seconds; got {self.pull_give_up_s!r}")
        if self.transfer_timeout_s < 1:
            raise ValueError(f"transfer_timeout_s must be at least 1 s; got {self.transfer_timeout_s!r}")
        if self.transfer_buffer_pages is not None and self.transfer_buffer_pages < 1:
            raise ValueError(f"transfer_buffer_pages must be at least 1; got {self.transfer_buffer_pages!r}")
        if self.lease_s <= 2 * self.clock_skew_s:
            raise ValueError("lease_s must exceed twice clock_skew_s, or no pull could ever start")
        if self.keyring is None:
            if self.cluster_secret is None:
                raise ValueError("a PD node needs the cluster secret (kvfence/pd/seal.py load_secret)")
            self.keyring = Keyring(SecretSet(self.cluster_secret, self.accepted_secrets))
        self.cluster_secret, self.accepted_secrets = None, ()
        if not 0 < self.router_scope_idle_s < float("inf"):
            raise ValueError(f"router_scope_idle_s must be a positive number of seconds; got "
                             f"{self.router_scope_idle_s!r}")
        if self.decode_reserve_tokens < 1:
            raise ValueError("decode_reserve_tokens must be at least 1")
        if self.max_pull_s < self.transfer_timeout_s:
            raise ValueError("max_pull_s must be at least the transfer engine's timeout")

    @property
    def secrets(self) -> SecretSet:
        """The secrets this node holds now (a SIGHUP may have read new ones)."""
        assert self.keyring is not None   # __post_init__ makes one
        return self.keyring.current

    def fence_after(self, deadline: float) -> float:
        """When rows held under a lease with this deadline are safe to reuse without an ACK."""
        return deadline + self.max_pull_s + self.clock_skew_s
