"""AWS for the platform: S3 (the lake, the UMLS release) through dagster-aws, and credentials that come only
from the environment or AWS Secrets Manager.

Credentials never enter resource config as values: resource config is shown
in the Dagster UI and stored with runs. Static keys are read by boto3 from the
usual chain (AWS_ACCESS_KEY_ID/..., a profile, an instance or task role), or,
when `credentials_secret_id` is set, fetched from Secrets Manager at run time
(a JSON secret with `aws_access_key_id`, `aws_secret_access_key` and optionally
`aws_session_token`). DuckDB gets them through an in-memory `CREATE SECRET`.
"""

import json
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
from dagster_aws.s3 import S3Resource
from dagster_aws.secretsmanager import SecretsManagerResource

from medgraph.s3 import S3Options, options_for


class SecretValueError(ValueError):
    """A Secrets Manager secret is missing or does not have the expected shape (the message never holds values)."""


class AwsSecretsResource(SecretsManagerResource):
    """Secrets Manager (dagster-aws's client, honouring `endpoint_url`): JSON secrets read at run time."""

    def json_secret(self, secret_id: str, required: tuple[str, ...] = ()) -> dict[str, str]:
        try:
            raw = self.get_client().get_secret_value(SecretId=secret_id)["SecretString"]
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
            # Say which secret failed, never what is in it.
            raise SecretValueError(f"cannot read secret {secret_id!r} from Secrets Manager: "
                                   f"{type(error).__name__}") from None
        try:
            values = json.loads(raw)
        except ValueError:
            raise SecretValueError(f"secret {secret_id!r} is not a JSON object") from None
        if not isinstance(values, dict):
            raise SecretValueError(f"secret {secret_id!r} is not a JSON object")
        missing = [k for k in required if not values.get(k)]
        if missing:
            raise SecretValueError(f"secret {secret_id!r} lacks the keys {missing}")
        return {k: str(v) for k, v in values.items()}


class LakeS3Resource(S3Resource):
    """dagster-aws's S3Resource (endpoint, region, retries, profile) for the lake and the release, plus the
    option to take the keys from a Secrets Manager secret instead of the environment."""

    credentials_secret_id: str | None = None
    """Secrets Manager secret (name or ARN) with aws_access_key_id / aws_secret_access_key; None: the AWS chain."""
    secrets_endpoint_url: str | None = None
    """Secrets Manager endpoint (a local emulator); None: AWS."""

    def _session(self) -> boto3.session.Session:
        keys: dict[str, str | None] = {"aws_access_key_id": self.aws_access_key_id,
                                       "aws_secret_access_key": self.aws_secret_access_key,
                                       "aws_session_token": self.aws_session_token}
        if self.credentials_secret_id:
            secret = AwsSecretsResource(region_name=self.region_name, endpoint_url=self.secrets_endpoint_url,
                                        profile_name=self.profile_name)
            values = secret.json_secret(self.credentials_secret_id, ("aws_access_key_id", "aws_secret_access_key"))
            keys = {k: values.get(k) for k in keys}
        return boto3.session.Session(profile_name=self.profile_name, region_name=self.region_name, **keys)

    def get_client(self) -> Any:
        # One session for the client and for DuckDB, so both act with the same identity.
        return self._client(self._session())

    def _client(self, session: boto3.session.Session) -> Any:
        config = botocore.config.Config(retries={"max_attempts": self.max_attempts, "mode": "standard"})
        return session.client("s3", endpoint_url=self.endpoint_url, use_ssl=self.use_ssl, verify=self.verify,
                              config=config)

    def client_and_options(self) -> tuple[Any, S3Options]:
        """The boto3 client and the same endpoint, region and (resolved) credentials for DuckDB."""
        session = self._session()
        client = self._client(session)
        return client, options_for(client, session)


def lake_s3_resource(endpoint_url: str | None = None, credentials_secret_id: str | None = None) -> LakeS3Resource:
    """The S3 resource from settings; everything else (region, keys) from the AWS environment."""
    # Secrets Manager's endpoint, when not AWS, comes from boto3's own AWS_ENDPOINT_URL_SECRETS_MANAGER.
    return LakeS3Resource(endpoint_url=endpoint_url, credentials_secret_id=credentials_secret_id)
