"""Create CurveZMQ key pairs with safe permissions (``weightpub keys create``).

``zmq.auth.create_certificates`` writes the secret file with the process umask
(often 0644), which ``security.check_secret_key_file`` then refuses. Here the
secret file is created 0600 from the start (``O_EXCL``: never over an existing
file), in the same format ``zmq.auth.load_certificate`` reads.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import zmq

from weightpub_wire.errors import ConfigError

__all__ = ["create_key_pair"]

_TEMPLATE = """#   ****  Generated on {when} by weightpub  ****
#   ZeroMQ CURVE {kind} Certificate
#   {note}

metadata
curve
    public-key = "{public}"
{secret_line}"""


def _write(path: Path, text: str, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError as exc:
        raise ConfigError(f"{path}: already exists (remove it first to make a new key)") \
            from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot create ({exc.strerror})") from exc
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, mode)  # the umask may have removed bits we want (never adds any)


def create_key_pair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``<name>.key`` (public, 0644) and ``<name>.key_secret`` (0600); return both paths."""
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name {name!r}: use a plain file name such as 'server'")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    public_path, secret_path = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists():
            raise ConfigError(f"{path}: already exists (remove it first to make a new key)")
    _write(secret_path, _TEMPLATE.format(
        when=when, kind="**Secret**", public=public.decode(),
        note="DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.",
        secret_line=f'    secret-key = "{secret.decode()}"\n'), 0o600)
    _write(public_path, _TEMPLATE.format(
        when=when, kind="**Public**", public=public.decode(),
        note="Exchange securely, or use a secure mechanism to verify the contents.",
        secret_line=""), 0o644)
    return public_path, secret_path
