"""`python -m kvscope.vllm join RUN`: write the run store of a vLLM run from its spool files."""

from __future__ import annotations

import sys

from agent.errors import InputError


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "join":
        print("usage: python -m kvscope.vllm join RUN_DIR", file=sys.stderr)
        return 2
    from kvscope.vllm.sink import join_run

    try:
        res = join_run(args[1])
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args[1]}: {res.requests:,} requests ({res.first_tokens:,} with a first token) "
          f"from {len(res.writers)} spool file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
