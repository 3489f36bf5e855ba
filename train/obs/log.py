"""Logging: every rank writes its own file; only rank 0 (or every rank, with DEBUG=1) prints to the console."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

FORMAT = "%(asctime)s [{who}] %(levelname)s %(message)s"
REDACTED = "<redacted>"
# Long words mean a credential wherever they appear in a name: GITHUB_TOKEN, DB_PASSWD, GOOGLE_APPLICATION_CREDENTIALS.
SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASS(WORD|WD|PHRASE)|CREDENTIAL|PRIVATE|COOKIE|SIGNATURE", re.IGNORECASE)
# Short words only as a whole word of the name, or PATH would hide behind PAT and SSH_ASKPASS behind PASS.
SECRET_WORD = re.compile(r"PAT|PWD?|PASS|O?AUTH|AUTHORIZATION|SESSION")
NAME_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")  # GH_PAT, DB-PWD and githubPat alike
# Paths, not credentials, though their names hold a short word: the shell's working directories, ssh-agent's socket.
NOT_SECRET = frozenset({"PWD", "OLDPWD", "SSH_AUTH_SOCK"})
# scheme://user:password@host, also with an empty user; the password runs to the last @ before the path, so that an
# unescaped @ in it cannot leave its tail readable. The scheme is taken whole (never from its middle): trying every
# letter of a long value as a scheme's first would take quadratic time.
URL_PASSWORD = re.compile(r"(?P<head>(?<![A-Za-z0-9+.-])[A-Za-z0-9+.-]+://[^\s/?#@:]*:)(?P<password>[^\s/?#]+)@")
# Credentials inside a value: a connection string's Key=value parts (Azure's AccountKey=...;, SharedAccessSignature=,
# a database's Password=...;) run to the next ';'; a signed URL's query parameters (sig=, X-Amz-Signature=) to '&'.
SETTING_SECRET = re.compile(
    r"(?P<head>(?<![A-Za-z0-9])(?:AccountKey|SharedAccessKey|SharedAccessSignature|Password|Pwd|AccessKey|SecretKey"
    r"|ClientSecret|ApiKey)\s*=\s*)(?P<password>[^;\s]+)",
    re.IGNORECASE,
)
QUERY_SECRET = re.compile(
    r"(?P<head>[?&](?:sig|signature|token|access_token|X-Amz-Signature|X-Amz-Security-Token|X-Goog-Signature)=)"
    r"(?P<password>[^&\s;]+)",
    re.IGNORECASE,
)
# Shorter known values (KEY=1, a port) would blank common substrings everywhere.
MIN_KNOWN_LENGTH = 6


def debug_enabled() -> bool:
    """DEBUG=1 (or any value but 0/false): verbose NCCL/c10d, every rank on the console, DEBUG log level."""
    return os.environ.get("DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def secret_name(name: str) -> bool:
    """Whether a variable's name says its value is a credential (DB_PASSWD, GH_PAT; not PATH, PWD or OLDPWD)."""
    if name in NOT_SECRET:
        return False
    return bool(SECRET_NAME.search(name)) or any(SECRET_WORD.fullmatch(w.upper()) for w in NAME_WORD.findall(name))


def redacted_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for debug logs, sorted by name, with credentials replaced by <redacted>.

    A variable named like a credential loses its whole value; in every other value the password of a URL
    (scheme://user:<redacted>@host), a connection string's secret parts (AccountKey=<redacted>;), a signed URL's
    signature (?sig=<redacted>) and any copy of a known credential (the value of a variable redacted by
    name, or a URL's password, of 6 characters or more) are replaced.
    """
    secret = {name for name in environ if secret_name(name)}
    # Credentials get copied under innocent names (BACKUP_ARGS="--key $B2_APPLICATION_KEY"): hide every copy.
    known = {environ[name] for name in secret}
    inside = (URL_PASSWORD, SETTING_SECRET, QUERY_SECRET)
    known |= {m["password"] for value in environ.values() for pattern in inside for m in pattern.finditer(value)}
    # Longest first, so that a credential holding a shorter one is hidden whole.
    longest_first = sorted((k for k in known if len(k) >= MIN_KNOWN_LENGTH), key=len, reverse=True)
    copies = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None

    def clean(value: str) -> str:
        value = URL_PASSWORD.sub(rf"\g<head>{REDACTED}@", value)
        value = QUERY_SECRET.sub(rf"\g<head>{REDACTED}", SETTING_SECRET.sub(rf"\g<head>{REDACTED}", value))
        return copies.sub(REDACTED, value) if copies else value

    return {name: REDACTED if name in secret else clean(value) for name, value in sorted(environ.items())}


def setup_logging(who: str = "launcher", log_file: Path | None = None, console: bool = True) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO)
    # Only our own loggers go to DEBUG: libraries' debug output (HTTP clients) can carry credentials.
    logging.getLogger("train").setLevel(logging.DEBUG if debug_enabled() else logging.NOTSET)
    formatter = logging.Formatter(FORMAT.format(who=who), datefmt="%H:%M:%S")
    if console or debug_enabled():
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(formatter)
        root.addHandler(stream)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file)
        handler.setFormatter(formatter)
        root.addHandler(handler)
    # torch.distributed's elastic agent logs every worker start at INFO; keep the console readable.
    logging.getLogger("torch.distributed").setLevel(logging.INFO if debug_enabled() else logging.WARNING)
