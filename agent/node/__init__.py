"""The node agent behind `kvscope agent`: collectors, /metrics, run store, OTLP.

`NodeAgent(AgentConfig(...)).start()` then `serve_forever()`; see `agent.node.daemon`.
`NodeAgent` is imported lazily so that `agent.node.config` stays as light as the CLI needs.
"""

from typing import Any

from agent.node.config import DEFAULT_PORT, AgentConfig

__all__ = ["DEFAULT_PORT", "AgentConfig", "NodeAgent"]


def __getattr__(name: str) -> Any:
    if name == "NodeAgent":
        from agent.node.daemon import NodeAgent

        return NodeAgent
    raise AttributeError(f"module 'agent.node' has no attribute {name!r}")
