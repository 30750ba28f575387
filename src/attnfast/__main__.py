"""Command line: ``python -m attnfast info | demo | bench`` (also installed as ``attnfast``)."""
from __future__ import annotations

import sys

COMMANDS = {
    "info": "show the build: version, kernel tier, threads, OpenMP",
    "demo": "the worked examples, then a timed 4k-token causal prefill",
    "bench": "prefill, KV-cache decode and cached-vs-recompute generation timings against this "
             "machine's measured memory bandwidth and GEMM throughput (--help for options)",
}


def _usage() -> str:
    lines = ["usage: attnfast {" + ",".join(COMMANDS) + "} [options]   |   attnfast --version", ""]
    lines += [f"  {name:6s} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run one subcommand; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from . import __version__
        print(f"attnfast {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(_usage())
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    # Each command imports only what it needs, so `info` stays instant.
    if command == "info":
        from ._runtime import show_config
        show_config()
        return 0
    if command == "bench":
        from .bench.cli import main as bench_main
        return bench_main(rest)
    from . import _demo
    return _demo.run(rest)


if __name__ == "__main__":
    sys.exit(main())
