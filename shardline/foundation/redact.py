"""Secrets inside URIs, masked before anything is printed, logged or tracked.

A tracking URI like postgresql://user:password@host/db, an Optuna storage URL or a
signed object-store URL carries its credential in the text itself; printed verbatim
it ends up in CI logs, terminals and MLflow params that many people can read.
`redact` masks the password of every `scheme://user:password@host`, a bare
`scheme://TOKEN@host` (a token as the whole user part, as git hosts and HTTP APIs take
it: a user name alone cannot be told from one, so it is masked too) and the value of
every secret-looking query parameter (password=, token=, sig=, X-Amz-Signature=, ...)
as ***, anywhere in a longer message, and leaves everything else as written, so the
host and database a message names still tell the user where to look.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://user:password@ -- the password stops at the authority's '@' (a literal '@'
# in a password has to be written %40, so the first '@' closes it) and never spans
# whitespace or a '/' (which would already be the path).
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@]*:)([^\s/@]+)(@)")
# scheme://TOKEN@ -- a user part without a ':', all of it; but not Azure's
# abfs[s]://container@account... and wasb[s]://, where the part before '@' is a container.
_TOKEN = re.compile(r"(\b(?!(?:abfss?|wasbs?)://)[A-Za-z][A-Za-z0-9+.\-]*://)([^\s:/@]+)(@)")

# ?name=value / &name=value / ;name=value (Spark Connect: sc://host/;token=...), for names
# that end like a secret: password, pwd, token, secret, sig, signature, key, credential.
_PARAM = re.compile(
    r"([?&;][\w.\-]*?(?:password|passwd|pwd|token|secret|sig|signature|key|credential)=)([^&;#\s'\"]+)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """`text` with every URI password or token and secret query value replaced by ***."""
    if not text or ("://" not in text and "=" not in text):
        return text
    text = _USERINFO.sub(lambda m: m.group(1) + MASK + m.group(3), text)
    text = _TOKEN.sub(lambda m: m.group(1) + MASK + m.group(3), text)
    return _PARAM.sub(lambda m: m.group(1) + MASK, text)
