"""A store on a remote filesystem (fsspec; S3 through s3fs): bounded network settings and one-line errors
that say what is wrong with the store's location or credentials."""
from __future__ import annotations

import os
from typing import Any

import fsspec

from drafter.core.errors import ConfigError

S3_PROTOCOLS = ("s3", "s3a")
# Network bounds of an S3 store (s3fs over botocore). Unbounded, one unreachable endpoint cost 22 s of
# retries (botocore's 5 attempts inside each of s3fs's 5) before a traceback. A stage still retries a
# dropped connection (3 attempts, AWS's "standard" mode, inside s3fs's 3); botocore settings the user gives
# fsspec (FSSPEC_S3_CONFIG_KWARGS='{"connect_timeout": 30}') win over these.
S3_STORE_OPTIONS = {"retries": 3, "config_kwargs": {"connect_timeout": 5,
                                                    "retries": {"mode": "standard", "total_max_attempts": 3}}}
# The preflight probe (Store.check_access): one request, one attempt, short timeouts (these win over the user's).
S3_PROBE_OPTIONS = {"retries": 1, "config_kwargs": {"connect_timeout": 3, "read_timeout": 5,
                                                    "retries": {"mode": "standard", "total_max_attempts": 1}}}
# S3 error codes of credentials the server does not accept (a missing or wrong key, a bad signature, an old token)
_S3_REJECTED = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired",
                "InvalidClientTokenId", "UnrecognizedClientException", "AuthorizationHeaderMalformed")


class StoreAccessError(ConfigError):
    """A remote store cannot be used from this machine: no credentials, credentials refused, no such bucket,
    an endpoint that does not answer. The message names the store URL, what is wrong and what to set; never a
    secret. ``permanent`` is False for an unreachable endpoint (a retry may find it up), True otherwise."""

    def __init__(self, message: str, permanent: bool = True):
        super().__init__(message)
        self.permanent = permanent


def open_fs(root: str, probe: bool = False) -> tuple[Any, str]:
    """``fsspec.core.url_to_fs(root)``, with bounded timeouts and retries on S3 (:data:`S3_STORE_OPTIONS`;
    ``probe``: :data:`S3_PROBE_OPTIONS` on a fresh, uncached filesystem). Other protocols: fsspec's defaults."""
    protocol = fsspec.core.split_protocol(root)[0]
    if protocol not in S3_PROTOCOLS:
        return fsspec.core.url_to_fs(root)
    user = {**fsspec.config.conf.get("s3", {}), **fsspec.config.conf.get(protocol, {})}
    ours = S3_PROBE_OPTIONS if probe else S3_STORE_OPTIONS
    user_config = user.get("config_kwargs") or {}
    if probe:
        kw = {"config_kwargs": {**user_config, **ours["config_kwargs"]}, "skip_instance_cache": True}
    else:
        kw = {"config_kwargs": {**ours["config_kwargs"], **user_config}}
    fs, path = fsspec.core.url_to_fs(root, **kw)
    fs.retries = ours["retries"]  # s3fs's own retry loop around each call (a class attribute, not an argument)
    return fs, path


def _s3_endpoint_setting() -> tuple[str, str] | None:
    """(variable, value) of the environment variable that sets the S3 endpoint, if one does."""
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(var):
            return var, os.environ[var]
    return None


def _host_port(url: str) -> str:
    from urllib.parse import urlsplit

    u = urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    return f"{u.hostname}:{port}"


def describe_access_error(root: str, e: BaseException) -> StoreAccessError | None:
    """What is wrong with the remote store ``root``, from an error of its filesystem (s3fs / botocore, also
    when wrapped as an OSError): no credentials, credentials refused, access denied, no such bucket, endpoint
    unreachable — one line with what to set. None for an error it does not recognise."""
    try:
        from botocore import exceptions as bx
    except ImportError:
        return None
    from drafter.core.urls import redact_url

    where = f"store.root {redact_url(root)}"
    creds_fix = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for temporary credentials), "
                 "or AWS_PROFILE naming a profile in ~/.aws/credentials, in the environment of the run")
    endpoint = _s3_endpoint_setting()
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)):
            what = ("no AWS credentials found (environment, AWS_PROFILE / ~/.aws, instance metadata)"
                    if isinstance(x, bx.NoCredentialsError) else f"incomplete AWS credentials ({x})")
            return StoreAccessError(f"{where}: {what}; {creds_fix}, or use a local store (--store DIR)")
        if isinstance(x, bx.ProfileNotFound):
            return StoreAccessError(f"{where}: the AWS profile {x.kwargs.get('profile')!r} (AWS_PROFILE) is not in "
                                    f"~/.aws/config or ~/.aws/credentials; fix AWS_PROFILE or add that profile")
        if isinstance(x, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ConnectionClosedError,
                          bx.ReadTimeoutError)):
            url = x.kwargs.get("endpoint_url") or (endpoint[1] if endpoint else "")
            why = {bx.ConnectTimeoutError: "connect timed out", bx.ReadTimeoutError: "no answer in time",
                   bx.ConnectionClosedError: "connection closed"}.get(type(x), "cannot connect")
            fix = (f"check {endpoint[0]} ({redact_url(endpoint[1])}) and that the S3 server runs and is reachable "
                   "from this machine" if endpoint else
                   "check this machine's network, or set AWS_ENDPOINT_URL for an S3-compatible server")
            return StoreAccessError(f"{where}: S3 endpoint unreachable: {_host_port(url)} ({why}); {fix}",
                                    permanent=False)
        if isinstance(x, bx.SSLError):
            url = x.kwargs.get("endpoint_url") or ""
            return StoreAccessError(f"{where}: TLS with the S3 endpoint {_host_port(url)} failed; check "
                                    f"{endpoint[0] if endpoint else 'AWS_ENDPOINT_URL'} (http:// or https://) and "
                                    "AWS_CA_BUNDLE")
        if isinstance(x, bx.ParamValidationError):
            return StoreAccessError(f"{where}: not a valid S3 location ({' '.join(str(x).split())}); fix store.root "
                                    "(s3://BUCKET/PREFIX)")
        if isinstance(x, bx.ClientError):
            err = x.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = x.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            bucket = root.split("://", 1)[-1].split("/", 1)[0]
            at = f" at {endpoint[0]}={redact_url(endpoint[1])}" if endpoint else ""
            if code in _S3_REJECTED:
                return StoreAccessError(f"{where}: AWS credentials rejected by the S3 server ({code}){at}; check "
                                        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the profile) and that they "
                                        "belong to this endpoint")
            if code in ("AccessDenied", "AllAccessDisabled", "403") or status == 403:
                return StoreAccessError(f"{where}: access denied ({code or status}){at}; give these AWS credentials "
                                        f"list, read and write access to s3://{bucket}, or set AWS credentials that "
                                        "have it")
            if code in ("NoSuchBucket", "404") or status == 404:
                return StoreAccessError(f"{where}: the bucket {bucket!r} does not exist{at}; create it "
                                        f"(aws s3 mb s3://{bucket}) or fix store.root")
            return None
        x = x.__cause__ or x.__context__
    return None
