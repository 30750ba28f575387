"""The benchmarks' building blocks, shared by ``attnfast bench`` and bench/compare_peers.py.

* :mod:`~attnfast.bench.costs`   the cost model: useful FLOPs of prefill, bytes of a decode step;
* :mod:`~attnfast.bench.limits`  the machine: CPU, caches, memory-read bandwidth, GEMM throughput;
* :mod:`~attnfast.bench.timing`  timing a call, thread settings, a progress bar, the decode and
  generation runners of ``attnfast bench``;
* :mod:`~attnfast.bench.report`  tables (text or markdown), number formats, JSON;
* :mod:`~attnfast.bench.peer_report`  the report of a compare_peers run, from its JSON;
* :mod:`~attnfast.bench.plot`    matplotlib figures;
* :mod:`~attnfast.bench.cli`     the ``attnfast bench`` command;
* :mod:`~attnfast.bench.results` docs/results.md and its plots from bench/results/*.json.

Nothing here is imported by ``import attnfast``; the optional libraries (tqdm, tabulate,
matplotlib, threadpoolctl, torch) are imported where they are used, and each has a fallback or
a clear message when it is missing.
"""
