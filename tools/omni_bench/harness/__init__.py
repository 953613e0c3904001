"""The harness every `omni-bench` subcommand shares, so that a benchmark module holds only what
it measures:

    server   a server as the bench's child process (omni-server on a repository, or a peer's):
             a free loopback port, ready once a URL answers 200, stopped by SIGTERM, and for
             omni-server a check that no stage process, run directory or ring segment is left
    timing   closed-loop load, percentiles (one definition for every table), the machine
    tables   markdown table lines: a header, rows (printed as they come, or joined)
    plots    figures against concurrency, written as PNG
    gpu      the GPU's memory in use (nvidia-smi): now, and a run's peak
    served_args  the options every served benchmark takes alike (--rounds, --min-requests,
             --ready-timeout, --out, the omni-server arguments after --)
"""
