"""What a run shows while it runs: `dashboard` (the terminal's live view) and `metrics`
(Prometheus text, `--metrics-port`)."""

__all__: list[str] = []  # its rooms are imported by module
