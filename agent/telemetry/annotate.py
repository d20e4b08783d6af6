"""Range annotations for external profilers: NVTX (domain ``kvscope``) and, optionally, the
PyTorch profiler's ``record_function`` ranges (``kvscope.<name>#<payload>``, see
`TorchProfilerAnnotator`) so Kineto traces carry them.

Request stages overlap across requests, so they use NVTX start/end ranges (process-wide, not
nested); nested step phases use push/pop. The message is the stage or phase name and the payload
the request number (`request_num`) or step id.

With no NVTX tool attached (Nsight Systems, this CPU-only machine), ``nvtx.get_domain`` returns a
dummy domain whose calls are no-ops, so the calls cost a few tens of ns and are always made.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

NVTX_DOMAIN = "kvscope"
#: prefix of the torch profiler range names (see `TorchProfilerAnnotator`)
TORCH_PREFIX = "kvscope."


class NvtxAnnotator:
    """Cached NVTX event attributes per name; one domain for all of kvscope.

    Args:
        names: the range names to pre-register (stage and phase names).
        domain: the NVTX domain to annotate on; default `nvtx.get_domain("kvscope")`, which is
            nvtx's no-op dummy when no tool is attached. (Tests and benchmarks pass a real
            `nvtx.Domain` to run the profiler's code path without a tool.)
    """

    def __init__(self, names: tuple[str, ...], *, domain: Any = None) -> None:
        self.available = False
        self.real = False
        self._attrs: dict[str, Any] = {}
        self._domain: Any = None
        try:
            import nvtx
            from nvtx._lib import Domain as _RealDomain

            dom = nvtx.get_domain(NVTX_DOMAIN) if domain is None else domain
            self.real = isinstance(dom, _RealDomain)
            self._domain = dom
            for n in names:
                self._attrs[n] = dom.get_event_attributes(message=n)
            self.available = True
        except Exception as exc:  # nvtx missing or broken: annotate nothing, never fail
            log.info("NVTX annotations disabled: %s", exc)

    @property
    def domain(self) -> Any:
        """The nvtx domain (a no-op dummy when no tool is attached)."""
        return self._domain

    def attributes(self, name: str) -> Any:
        attrs = self._attrs.get(name)
        if attrs is None and self._domain is not None:
            attrs = self._attrs[name] = self._domain.get_event_attributes(message=name)
        return attrs

    def start(self, name: str, payload: int) -> int:
        """Start a process-wide range; returns its id for `end`."""
        dom = self._domain
        if dom is None:
            return 0
        if self.real:
            attrs = self.attributes(name)
            attrs.payload = payload  # what start_range(attrs, payload=...) sets, more cheaply
            return dom.start_range(attrs)
        return dom.start_range(None)

    def end(self, range_id: int) -> None:
        dom = self._domain
        if dom is not None and range_id:
            dom.end_range(range_id)

    def push(self, name: str, payload: int) -> None:
        dom = self._domain
        if dom is None:
            return
        if self.real:
            attrs = self._attrs.get(name) or self.attributes(name)
            attrs.payload = payload  # what push_range(attrs, payload=...) sets, more cheaply
            dom.push_range(attrs)
        else:
            dom.push_range(None)

    def pop(self) -> None:
        dom = self._domain
        if dom is not None:
            dom.pop_range()


class TorchProfilerAnnotator:
    """``record_function`` ranges named ``kvscope.<name>#<payload>``, under `kvscope run --profile`.

    Name format (parsed back by `analyzers.importers.kineto`)::

        kvscope.<name>#<payload>      e.g. kvscope.queue#12, kvscope.forward#3

    ``<name>`` is a request state (`STATES`: the payload is the request's `request_num`) or a
    step phase (`STEP_PHASES`: the payload is the step id); ``<payload>`` is a decimal integer.
    The payload is in the name because the profiler drops a range's argument string: torch
    2.13's Chrome trace shows ``_record_function_enter_new(name, args)`` with no trace of
    ``args`` (``Concrete Inputs: ['']`` at most, with ``record_shapes``), and the keyword
    values of ``_RecordFunctionFast`` appear only with ``record_shapes=True`` and as a
    ``cpu_op``. Names therefore differ per request; group by the part before ``#``.

    Uses the profiler's enter/exit ops so a range can start in one call and end in another
    (request stages are not lexically nested).
    """

    def __init__(self) -> None:
        import torch  # only imported when profiling was asked for

        self._enter = torch.ops.profiler._record_function_enter_new
        self._exit = torch.ops.profiler._record_function_exit
        self._open: dict[int, Any] = {}
        self._next = 1

    @staticmethod
    def range_name(name: str, payload: int) -> str:
        """The profiler range name of stage/phase `name` for request number or step `payload`."""
        return f"{TORCH_PREFIX}{name}#{int(payload)}"

    def start(self, name: str, payload: int) -> int:
        """Open a range; returns its id for `end`."""
        handle = self._enter(self.range_name(name, payload), None)
        rid = self._next
        self._next += 1
        self._open[rid] = handle
        return rid

    def end(self, range_id: int) -> None:
        handle = self._open.pop(range_id, None)
        if handle is not None:
            self._exit(handle)
