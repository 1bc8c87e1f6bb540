"""Keep object-store credentials (S3, Azure, GCS) out of every log line, whoever logs it.

With DEBUG logging on, botocore logs each request's headers — the Authorization header names
the access key id, and X-Amz-Security-Token is the session token itself. A filter on one
logger does not see records of its children, and handlers are the application's, so the
redaction sits in the log record factory: any record whose text contains a credential that
distckpt was given (or found in the environment variables a backend's spec names as secret:
AWS_SECRET_ACCESS_KEY, AZURE_STORAGE_KEY ...) has it replaced before any handler,
formatter or capture sees it.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from distckpt.storage.registry import secret_environment, secret_options

_MIN_SECRET_LEN = 8  # shorter values would redact ordinary words
# Inside a GCS service-account token given as a dict, and inside an Azure connection string.
_TOKEN_FIELDS = ("private_key", "private_key_id", "refresh_token", "client_secret", "access_token")
_CONNECTION_STRING_FIELDS = ("AccountKey", "SharedAccessSignature")
# A signed request names its access key id in the Authorization header's Credential= field, however
# short the key (test servers' keys are shorter than _MIN_SECRET_LEN).
_CREDENTIAL_FIELD = re.compile(r"(Credential=)[^/,\s'\"]+")
_secrets: set[str] = set()
_installed = False


def protect_credentials(storage_options: dict[str, Any]) -> None:
    """Register the credentials in `storage_options` (and the backends' secret environment
    variables) for redaction."""
    names = secret_options()  # every backend's (registry.py)
    found = [storage_options.get(k) for k in names]
    client = storage_options.get("client_kwargs") or {}
    found += [client.get(k) for k in names]
    found += [os.environ.get(k) for k in secret_environment()]  # every backend's (registry.py)
    token = storage_options.get("token")
    if isinstance(token, dict):
        found += [token.get(k) for k in _TOKEN_FIELDS]
    found += [part for v in found if isinstance(v, str) for part in _connection_string_secrets(v)]
    _secrets.update(v for v in found if isinstance(v, str) and len(v) >= _MIN_SECRET_LEN)
    _install()


def _connection_string_secrets(value: str) -> list[str]:
    """The key and signature inside an Azure connection string ("...;AccountKey=...;")."""
    fields = dict(p.split("=", 1) for p in value.split(";") if "=" in p)
    return [fields[k] for k in _CONNECTION_STRING_FIELDS if fields.get(k)]


def redact(text: str) -> str:
    if "Credential=" in text:
        text = _CREDENTIAL_FIELD.sub(r"\1***", text)
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, "***")
    return text


def _install() -> None:
    global _installed
    if _installed or not _secrets:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's to report
            return record
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
