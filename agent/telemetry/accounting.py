"""The per-request token, byte and count accounting row (docs/DESIGN.md, "Token accounting")."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, fields
from operator import attrgetter

from agent.schema import ACCOUNTING_COLUMNS


@dataclass(slots=True)
class RequestAccounting:
    """Token, byte and count accounting of one request (docs/DESIGN.md, "Token accounting").

    NOTE: prompt_tokens == device_hit_tokens + host_loaded_tokens + remote_loaded_tokens +
    recomputed_tokens must hold when the request has produced its first token.
    """

    prompt_tokens: int = 0
    output_tokens: int = 0
    lookup_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    host_found_tokens: int = 0
    remote_found_tokens: int = 0
    host_loaded_tokens: int = 0
    remote_loaded_tokens: int = 0
    recomputed_tokens: int = 0
    preempted_tokens: int = 0
    preempted_loaded_tokens: int = 0
    load_failed_tokens: int = 0
    load_failed_timeout_tokens: int = 0
    load_failed_checksum_tokens: int = 0
    load_failed_mismatch_tokens: int = 0
    load_failed_error_tokens: int = 0
    load_failed_circuit_open_tokens: int = 0
    load_failed_evicted_tokens: int = 0
    host_read_bytes: int = 0
    remote_read_bytes: int = 0
    h2d_bytes: int = 0
    host_written_bytes: int = 0
    remote_written_bytes: int = 0
    num_preemptions: int = 0

    def identity_holds(self) -> bool:
        """Whether the prompt tokens split exactly into the four KV sources."""
        return self.prompt_tokens == (self.device_hit_tokens + self.host_loaded_tokens
                                      + self.remote_loaded_tokens + self.recomputed_tokens)

    def values(self) -> tuple[int, ...]:
        """The fields in `ACCOUNTING_COLUMNS` order."""
        return _fields(self)

    def checked_values(self) -> tuple[int, ...]:
        """`values()`, validated as non-negative int64s.

        Raises:
            struct.error, ValueError: a field is not an integer or does not fit int64
                (struct.error), or is negative (ValueError): the run store's accounting
                columns are non-negative int64.
        """
        # One C-level type/range check of every field, and them back as plain ints.
        vals = _INT64S.unpack(_INT64S.pack(*_fields(self)))
        if min(vals) < 0:
            bad = [c for c, v in zip(ACCOUNTING_COLUMNS, vals, strict=True) if v < 0]
            raise ValueError(f"negative accounting field(s): {', '.join(bad)}")
        return tuple(vals)


assert tuple(f.name for f in fields(RequestAccounting)) == ACCOUNTING_COLUMNS
#: Every accounting field in one C call (a request's row is recorded at its end).
_fields: Callable[[RequestAccounting], tuple[int, ...]] = attrgetter(*ACCOUNTING_COLUMNS)
_INT64S = struct.Struct(f"{len(ACCOUNTING_COLUMNS)}q")
