"""Scrub credentials from text that leaves a trust boundary (sandbox output kept in evaluation files).

A pattern list, not a proof: it removes what commonly looks like a secret (cloud access keys, API
tokens, ``NAME=value`` pairs whose name says secret, authorization headers, PEM blocks) so that such
a string printed by untrusted code does not end up in files that are committed, pushed or reported.
"""

from __future__ import annotations

import re

REDACTED = "[REDACTED]"

# Values recognisable by their shape alone.
_SHAPES = [
    re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?(?:-----END [A-Z0-9 ]+-----|\Z)", re.DOTALL),  # PEM (cut short too)
    re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA|ABIA|ACCA)[A-Z0-9]{16}\b"),  # AWS key ids
    re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,}|\bgithub_pat_[A-Za-z0-9_]{30,}"),  # GitHub
    re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}|\bxox[abprs]-[A-Za-z0-9-]{10,}"),  # GitLab, Slack
    re.compile(r"\b(?:sk|rk)-[A-Za-z0-9_-]{20,}|\bhf_[A-Za-z0-9]{30,}|\bAIza[0-9A-Za-z_-]{35}"),  # API keys
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),  # JSON web tokens
]
_AUTHORIZATION = re.compile(r"(?i)\b((?:bearer|basic|token)\s+)[A-Za-z0-9._~+/=-]{8,}")
# NAME=value, NAME: value, "NAME": "value" (the name is judged by _secret_name)
_PAIR = re.compile(r"""(\b[A-Za-z][\w.-]*["']?[ \t]*(?:=|:)(?!=)[ \t]*)("[^"\n]*"|'[^'\n]*'|[^\s,;'"}\]]+)""")
_SECRET_WORDS = {"secret", "secrets", "token", "tokens", "password", "passwd", "pwd", "passphrase", "credential",
                 "credentials", "apikey", "auth", "authorization", "cookie", "session"}


def _secret_name(name: str) -> bool:
    """AWS_SECRET_ACCESS_KEY, api_key, db-password, token: yes; KeyError, monkey, author: no."""
    words = [w for w in re.split(r"[_.\-\"' \t:=]+|(?<=[a-z])(?=[A-Z])", name) if w]
    lower = [w.lower() for w in words]
    return bool(_SECRET_WORDS & set(lower)) or (len(lower) > 1 and lower[-1] == "key")


def redact_secrets(text: str) -> str:
    """``text`` with everything that looks like a credential replaced by ``[REDACTED]``."""
    for shape in _SHAPES:
        text = shape.sub(REDACTED, text)
    text = _AUTHORIZATION.sub(lambda m: m.group(1) + REDACTED, text)
    return _PAIR.sub(lambda m: m.group(1) + REDACTED if _secret_name(m.group(1)) else m.group(0), text)
