"""Command line: ``python -m attnfast info | demo`` (also installed as ``attnfast``)."""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"info": "show the build: version, kernel tier, threads, OpenMP",
                "demo": "the worked examples, then a timed 4k-token causal prefill"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: attnfast {" + ",".join(commands) + "} [options]\n")
        for name, text in commands.items():
            print(f"  {name:6s} {text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        from ._runtime import show_config
        show_config()
        return 0
    from . import _demo
    return _demo.run(rest)


if __name__ == "__main__":
    sys.exit(main())
