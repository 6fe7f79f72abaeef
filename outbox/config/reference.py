"""docs/config-reference.md, written from the declarations in outbox.config.

    python -m outbox.config.reference > docs/config-reference.md

A unit test fails while the file differs from :func:`reference`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Final

from outbox.config.options import PROVIDER_OPTIONS
from outbox.config.schema import REQUIRED, Secret, Setting, settings_of
from outbox.config.settings import TABLES, ProviderSettings, Settings

COMMAND: Final = "python -m outbox.config.reference > docs/config-reference.md"

_HEADER: Final = f"""\
# Configuration reference

<!-- Generated from the declarations in outbox/config/: do not edit by hand. After changing a
key there, run `{COMMAND}`. -->

`outbox run --config outbox.toml` reads a TOML file: an optional top-level `log_level`, a
`[dispatcher]` table, an optional `[database]` table and one `[providers.<name>]` table per
provider (a name is lower-case letters, digits, `_` and `-`, at most 64 characters). Every key
is optional unless it says *required*; an unknown key is refused, naming it.

The environment overrides the file: `OUTBOX_LOG_LEVEL`, `OUTBOX_DISPATCHER__<KEY>`,
`OUTBOX_DATABASE__<KEY>` and `OUTBOX_PROVIDERS__<NAME>__<KEY>`, where NAME matches a provider
whatever its case, with `-` written `_`; a provider that is not in the file is created when its
`TYPE` is set. Keys inside a provider's tables cannot be set from the environment.

A duration is written like `"500ms"`, `"30s"`, `"10m"`, `"24h"`, `"1h30m"`, or as a number of
seconds. Secrets are never written in the file: it names where each is, in an environment
variable or a file (a relative file name is looked up in `$CREDENTIALS_DIRECTORY`, systemd's
`LoadCredential=`).
"""

_COLUMNS: Final = "| key | value | default | environment | what it does, and why the default |\n"
_RULE: Final = "|---|---|---|---|---|\n"


def reference() -> str:
    """The whole reference, as docs/config-reference.md holds it."""
    parts = [_HEADER]
    parts.append(_table("Top level", settings_of(Settings), lambda key: f"OUTBOX_{key.upper()}"))
    for name, cls in TABLES.items():
        parts.append(_table(f"`[{name}]`", settings_of(cls), _env_of(f"OUTBOX_{name.upper()}__")))
    provider_env = _env_of("OUTBOX_PROVIDERS__<NAME>__")
    common = settings_of(ProviderSettings)
    parts.append(
        _table(
            "`[providers.<name>]`: every type",
            [s for s in common if not s.group],
            provider_env,
        )
    )
    parts.append(
        _table(
            "`[providers.<name>]`: its share of the dispatcher (every type)",
            [s for s in common if s.group],
            provider_env,
        )
    )
    for provider_type, options in PROVIDER_OPTIONS.items():
        parts.append(
            _table(f'`type = "{provider_type}"`', options, provider_env)
            if options
            else f'\n## `type = "{provider_type}"`\n\nNo other keys.\n'
        )
    parts.append(
        "\nA plug-in's type (an entry point of the group `outbox.providers`) takes any other "
        "keys, as written, and checks them itself.\n"
    )
    return "".join(parts)


def _env_of(prefix: str) -> Callable[[str], str]:
    return lambda key: prefix + key.upper()


def _table(title: str, settings: Iterable[Setting], env: Callable[[str], str]) -> str:
    rows = [f"\n## {title}\n\n", _COLUMNS, _RULE]
    for declared in settings:
        keys = list(declared.file_keys())
        kinds = list(declared.file_keys().values())
        if isinstance(declared.kind, Secret):  # never written itself: where it is
            value = " or ".join(kind.text() for kind in kinds)
            variables = ", ".join(f"`{env(key)}`" for key in keys)
        else:
            value = declared.kind.text()
            variables = f"`{env(declared.name)}`" if declared.env else "no"
        cells = (
            " or ".join(f"`{key}`" for key in keys),
            value,
            _default(declared),
            variables,
            _doc(declared),
        )
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |\n")
    return "".join(rows)


def _default(declared: Setting) -> str:
    if declared.default_doc is not None:
        return declared.default_doc
    if declared.default is REQUIRED:
        return "*required*"
    return f"`{declared.kind.toml(declared.default)}`"


def _doc(declared: Setting) -> str:
    if declared.requires is None:
        return declared.doc
    return f"{declared.doc} Only with `{declared.requires}`."


if __name__ == "__main__":
    sys.stdout.write(reference())
