"""How every service reads its settings: one typed object from flags, then STEPWIRE_<SERVICE>_* variables,
then defaults, checked before anything starts.

A Kubernetes manifest sets environment variables and a person at a shell passes flags; both reach the
same fields, so the two can never drift apart, and `--help` lists every knob with its default.
"""

from __future__ import annotations

import sys

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(cli_kebab_case=True, cli_implicit_flags=True, cli_use_class_docs_for_groups=False,
                                      extra="forbid", frozen=True)


def comma_separated(value):
    """A list setting given as one string (an environment variable, or a flag's comma-separated value): its
    non-empty items, stripped; anything else as it is."""
    return [item.strip() for item in value.split(",") if item.strip()] if isinstance(value, str) else value


def load(cls: type[ServiceSettings], argv: list[str] | None = None) -> ServiceSettings:
    """Parse `argv` (the process's arguments when None); a bad value exits with the field named."""
    try:
        return CliApp.run(cls, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        lines = [f"  {'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors()]
        sys.exit(f"{cls.model_config.get('cli_prog_name', 'stepwire')}: invalid settings\n" + "\n".join(lines))
