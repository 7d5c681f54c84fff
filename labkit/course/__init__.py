"""The course layer: what the notebooks call (checks and verdicts, plots, widgets, runners, the labs' cached runs).
May import every layer below; only the command line and entry points sit above it."""
