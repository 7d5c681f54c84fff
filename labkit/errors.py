"""One error family: what went wrong, where, and how to fix it."""


class LabkitError(Exception):
    """A user error: bad input, a missing file, a wrong parameter. The CLI prints it and exits 2."""

    def __init__(self, what: str, fix: str | None = None):
        self.what = what
        self.fix = fix
        super().__init__(what if not fix else f"{what}\n  fix: {fix}")


class LabkitFailure(LabkitError):
    """The input was fine but the work failed (a worker died, parity broke). The CLI exits 1."""
