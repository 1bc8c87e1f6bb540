"""Keep S3 credentials out of every log line, whoever logs it.

With DEBUG logging on, botocore logs each request's headers — the Authorization header names
the access key id, and X-Amz-Security-Token is the session token itself. A filter on one
logger does not see records of its children, and handlers are the application's, so the
redaction sits in the log record factory: any record whose text contains a credential that
distckpt was given (or found in the AWS_* environment) has it replaced before any handler,
formatter or capture sees it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

_MIN_SECRET_LEN = 8  # shorter values would redact ordinary words
_ENV_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_OPTION_SECRETS = ("key", "secret", "token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_secrets: set[str] = set()
_installed = False


def protect_credentials(storage_options: dict[str, Any]) -> None:
    """Register the credentials in `storage_options` (and the AWS_* environment) for redaction."""
    found = [storage_options.get(k) for k in _OPTION_SECRETS]
    client = storage_options.get("client_kwargs") or {}
    found += [client.get(k) for k in _OPTION_SECRETS]
    found += [os.environ.get(k) for k in _ENV_SECRETS]
    _secrets.update(v for v in found if isinstance(v, str) and len(v) >= _MIN_SECRET_LEN)
    _install()


def redact(text: str) -> str:
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
