"""Commands: the `tandem` CLI (``cli``: up, generate, serve, bench), `tandem serve`
(``serve_cli``), the load generator behind `tandem bench` (``loadgen``, ``loadgen_report``).
"""
