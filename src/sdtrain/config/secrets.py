"""The refusal of credentials in a config: every URI a config names (training's and preprocessing's) goes into
checkpoints, manifests, the shards' metadata, tracker params and logs, so none may carry a user name, a password or
a token in its query (``?token=``, ``access_token=``, a presigned URL's ``X-Amz-Signature=``). Refused rather than
redacted: the config is written whole, and a worker reads it back. Checked first, so that no other message repeats
the URI; the message redacts it."""

from __future__ import annotations

from sdtrain.errors import ConfigError
from sdtrain.storage.uris import has_userinfo, redact, secret_parameters

NEVER_FROM_CONFIG = (
    "credentials are never taken from the config (they would be copied into checkpoints, manifests and logs)"
)
AWS_CREDENTIALS = (
    "use the AWS credential chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)"
)
"""Where storage credentials come from instead: the default advice."""


def refuse_userinfo(key: str, uri: str | None, instead: str = AWS_CREDENTIALS) -> None:
    """Raise a ConfigError naming ``key`` when ``uri`` holds a user name, a password or a credential in its query;
    nothing when it does not (or is None).

    Args:
        key: the config key in full, e.g. ``storage.endpoint_url`` or ``input.paths[0]``.
        uri: its value.
        instead: where the credentials should come from (the message's last words).
    """
    if not uri:
        return
    if has_userinfo(uri):
        raise ConfigError(f"{key}: {redact(uri)} holds a user name or password; {NEVER_FROM_CONFIG}: {instead}")
    names = secret_parameters(uri)
    if names:
        held = ", ".join(dict.fromkeys(names))
        raise ConfigError(
            f"{key}: {redact(uri)} holds a credential in its query ({held}); {NEVER_FROM_CONFIG}: {instead}"
        )
