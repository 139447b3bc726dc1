"""``weightpub bench``: the benchmarks as one command, importable from the installed package.

``runner.run_bench`` runs the sections (``transport``, ``e2e``, ``streaming``,
``delta``; ``scale`` when asked for), ``report`` turns the result into rows and a
table. The scripts in ``benchmarks/`` are thin wrappers around these modules.
"""

from weightpub.bench.report import bench_table, summary
from weightpub.bench.runner import (
    DEFAULT_SECTIONS,
    SECTIONS,
    BenchOptions,
    run_and_print,
    run_bench,
)

__all__ = ["DEFAULT_SECTIONS", "SECTIONS", "BenchOptions", "bench_table", "run_and_print",
           "run_bench", "summary"]
