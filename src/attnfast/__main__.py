"""Command line: ``python -m attnfast info | demo | bench`` (also installed as ``attnfast``)."""
from __future__ import annotations

import sys

USAGE = """\
usage: attnfast {info,demo,bench} [options]

  info    version, kernel tier (ISA) chosen and available, threads, OpenMP runtime
  demo    a short tour: attention on a small example, checked and explained
  bench   prefill, KV-cache decode and cached-vs-recompute generation timings on this
          machine, against its measured memory bandwidth and GEMM throughput
          (`attnfast bench --help` for options; `--quick` for a smoke run)
"""


def main(argv=None) -> int:
    """Run one subcommand; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        if rest:
            print(f"attnfast info: takes no options, got {' '.join(rest)}", file=sys.stderr)
            return 2
        from . import show_config
        show_config()
        return 0
    if command == "demo":
        # Imported here so `info` and `bench` never pay for (or depend on) the demo.
        from . import _demo
        return _demo.run(rest) or 0
    if command == "bench":
        from . import _bench
        return _bench.main(rest)
    print(f"attnfast: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
