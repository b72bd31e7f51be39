"""Errors a user can act on. The CLI prints them without a traceback and exits 2."""

from __future__ import annotations

from dataclasses import dataclass


class RayloadError(Exception):
    """Base class for errors caused by the user's spec or data, not by a bug."""


@dataclass(frozen=True)
class SpecIssue:
    path: str
    message: str
    value: object = None
    has_value: bool = False

    def render(self) -> str:
        given = f" (got {self.value!r})" if self.has_value else ""
        return f"{self.path or '<root>'}: {self.message}{given}"


class SpecError(RayloadError):
    def __init__(self, issues: list[SpecIssue], file: str | None = None):
        self.issues = list(issues)
        self.file = file
        where = f" in {file}" if file else ""
        lines = [f"{len(self.issues)} problem(s){where}:"] + [f"  - {i.render()}" for i in self.issues]
        super().__init__("\n".join(lines))


class DataError(RayloadError):
    """Input data that cannot be used: a missing path, a wrong column type, too many bad rows."""


class FieldValueError(ValueError):
    """A model validator's complaint about one field of the model it validates: spec loading
    reports it at that field's path with its value (a plain ValueError is reported at the
    model's path, with the whole section as the value)."""

    def __init__(self, field: str, message: str, value):
        super().__init__(message)
        self.field, self.value = field, value
