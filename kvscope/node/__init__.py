"""The node agent behind `kvscope agent`: collectors, /metrics, run store, OTLP.

`NodeAgent(AgentConfig(...)).start()` then `serve_forever()`; see `kvscope.node.daemon`.
`NodeAgent` is imported lazily so that `kvscope.node.config` stays as light as the CLI needs.
"""

from typing import Any

from kvscope.node.config import DEFAULT_PORT, AgentConfig

__all__ = ["DEFAULT_PORT", "AgentConfig", "NodeAgent"]


def __getattr__(name: str) -> Any:
    if name == "NodeAgent":
        from kvscope.node.daemon import NodeAgent

        return NodeAgent
    raise AttributeError(f"module 'kvscope.node' has no attribute {name!r}")
