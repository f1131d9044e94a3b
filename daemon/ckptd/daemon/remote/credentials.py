"""The endpoint, region and credentials of the object store, the way AWS tools find them.

- Environment: AWS_ENDPOINT_URL_S3 > AWS_ENDPOINT_URL (endpoint), AWS_REGION >
  AWS_DEFAULT_REGION (region), AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN),
  AWS_PROFILE, AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE.
- With boto3 installed (the `s3` extra installs it): everything boto3 finds besides, through a
  boto3 session: profiles in ~/.aws/config and ~/.aws/credentials (their `region`, and their
  `endpoint_url` or `s3 = endpoint_url = ...`), SSO, web identity, container and instance
  credentials, refreshed when they expire (obstore.auth.boto3.Boto3CredentialProvider).
- Without boto3: obstore reads the same environment variables itself (no profiles or files).

boto3 is imported here only, inside functions: the daemon runs without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

FIX_CREDENTIALS = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary keys), or AWS_PROFILE "
    "naming a profile in ~/.aws/credentials or ~/.aws/config"
)


class CredentialsError(RuntimeError):
    """No usable credentials or profile; the message says which variable or file to fix."""


@dataclass(frozen=True)
class StoreSettings:
    """What the store is built from. `provider`: an obstore credential provider (None: obstore
    reads the environment itself). `source`: where the credentials come from, for messages."""

    endpoint: str | None
    region: str | None
    source: str
    provider: Any = field(default=None, repr=False)

    @property
    def allow_http(self) -> bool:
        """A plain-HTTP endpoint (a local test server, an on-premises gateway) is what the operator chose."""
        return self.endpoint is not None and self.endpoint.lower().startswith("http://")

    @property
    def shown_endpoint(self) -> str:
        return self.endpoint or f"AWS S3 ({self.region or 'us-east-1'})"


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def resolve(environ: Mapping[str, str]) -> StoreSettings:
    """The store's settings from the environment and, with boto3, the AWS config files.

    Raises CredentialsError when AWS_PROFILE names no profile or boto3 finds no credentials at all."""
    endpoint = _first(environ, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    region = _first(environ, "AWS_REGION", "AWS_DEFAULT_REGION")
    try:
        import boto3
        import botocore.exceptions
        import botocore.session
    except ImportError:
        source = "the AWS_* environment variables (boto3 is not installed: profiles and ~/.aws files are not read; pip install 'ckptd[s3]')"
        return StoreSettings(endpoint, region, source)
    from obstore.auth.boto3 import Boto3CredentialProvider

    profile = _first(environ, "AWS_PROFILE")
    try:
        core = botocore.session.get_session()
        session = boto3.Session(botocore_session=core)
        credentials = session.get_credentials()
        scoped = core.get_scoped_config()
    except botocore.exceptions.ProfileNotFound:
        raise CredentialsError(f"AWS_PROFILE={profile!r} names no profile in the AWS config files (~/.aws/config, ~/.aws/credentials): fix AWS_PROFILE or add the profile") from None
    except botocore.exceptions.BotoCoreError as exc:
        raise CredentialsError(f"the AWS credentials could not be read: {exc}; {FIX_CREDENTIALS}") from None
    if credentials is None:
        raise CredentialsError(f"no AWS credentials found (environment, AWS config files, instance or container role): {FIX_CREDENTIALS}")
    s3_section = scoped.get("s3") if isinstance(scoped.get("s3"), dict) else {}
    endpoint = endpoint or s3_section.get("endpoint_url") or scoped.get("endpoint_url")
    region = region or session.region_name
    method = getattr(credentials, "method", "") or "boto3"
    where = {"env": "the AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY environment variables", "shared-credentials-file": "~/.aws/credentials"}.get(method, method)
    source = f"{where}{f' (profile {profile})' if profile else ''}"
    return StoreSettings(endpoint, region, source, Boto3CredentialProvider(session))


def boto3_client(settings: StoreSettings) -> Any:
    """A boto3 S3 client for the calls obstore does not offer (listing and aborting unfinished
    multipart uploads), or None without boto3. Same endpoint, region and credentials."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        return None
    virtual = os.environ.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "").strip().lower() in ("1", "true")
    style = Config(s3={"addressing_style": "virtual" if virtual else "path"})  # as obstore addresses the bucket
    return boto3.Session().client("s3", endpoint_url=settings.endpoint, region_name=settings.region or "us-east-1", config=style)
