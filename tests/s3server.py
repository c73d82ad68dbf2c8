"""A real S3 protocol server for the tests: moto's, on a free loopback port, with IAM
authentication on, so wrong keys and missing permissions fail as they do on AWS or MinIO.

The job reaches it as users reach MinIO (docs/guide.md, "Object storage"): AWS_ENDPOINT_URL and
a credentials file, nothing in the job's flags. `Gate` holds chosen uploads, so a test can
interrupt a run while it writes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.request
from pathlib import Path

import boto3
from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

POLICIES = {  # IAM user -> the S3 actions it may take
    "writer": ["s3:*"],
    # AWS's names for reading, and moto 5.2's: it names some operations' actions after the operation
    # (ListObjectsV2 as s3:ListObjectsV2, HeadObject as s3:HeadObject), where AWS checks s3:ListBucket and
    # s3:GetObject; the reader may still do nothing but read
    "reader": ["s3:GetObject", "s3:ListBucket", "s3:GetBucketLocation", "s3:ListObjectsV2", "s3:HeadObject"]
    + ["s3:HeadBucket"],
}


class Gate:
    """WSGI middleware in front of moto. `hold(text)`: every upload (PUT/POST) whose path
    contains `text` waits until `release()` and is then answered 503, so it never completes;
    `arrived` is set when the first one comes in."""

    def __init__(self, app):
        self.app, self.text = app, None
        self.arrived, self.released = threading.Event(), threading.Event()

    def hold(self, text: str) -> None:
        self.arrived.clear()
        self.released.clear()
        self.text = text

    def release(self) -> None:
        self.text = None
        self.released.set()

    def __call__(self, environ, start_response):
        text = self.text
        if text and text in environ.get("PATH_INFO", "") and environ["REQUEST_METHOD"] in ("PUT", "POST"):
            self.arrived.set()
            self.released.wait(timeout=300)
            start_response("503 Service Unavailable", [("Content-Length", "0")])
            return [b""]
        return self.app(environ, start_response)


class S3Server:
    """moto's S3 and IAM on 127.0.0.1:<free port>; `keys[user]` = (access key, secret) of
    the users in POLICIES; `client` is boto3 as the writer, for the tests' own checks."""

    def __init__(self):
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
        self.gate = Gate(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, self.gate, threaded=True, request_handler=MotoRequestHandler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="moto")
        self._thread.start()
        admin = self._client("iam", "admin", "admin")  # authentication is still off
        self.keys = {}
        for user, actions in POLICIES.items():
            admin.create_user(UserName=user)
            policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
            admin.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
            key = admin.create_access_key(UserName=user)["AccessKey"]
            self.keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
        # moto's switch for IAM authentication in server mode: every request from now on is checked
        reset = f"{self.endpoint}/moto-api/reset-auth"
        urllib.request.urlopen(urllib.request.Request(reset, data=b"0", headers={"Content-Type": "text/plain"}))
        self.client = self._client("s3", *self.keys["writer"])

    def _client(self, service: str, key: str, secret: str):
        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name="us-east-1",
        )

    def environment(self, home: Path) -> dict[str, str]:
        """What a user of an S3-compatible server sets: the endpoint, and the writer's key in
        an AWS credentials file (here under `home` rather than ~/.aws)."""
        home.mkdir(parents=True, exist_ok=True)
        key, secret = self.keys["writer"]
        (home / "credentials").write_text(f"[default]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
        (home / "config").write_text("[default]\nregion = us-east-1\n")
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "credentials"),
            "AWS_CONFIG_FILE": str(home / "config"),
            "AWS_EC2_METADATA_DISABLED": "true",  # no instance-role lookup on a machine that has none
        }

    def upload(self, local: Path, uri: str) -> str:
        """Copy the tree `local` to `uri` (s3://bucket/prefix); returns `uri`."""
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            self.client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")
        return uri

    def objects(self, uri: str) -> dict[str, int]:
        """{key relative to `uri`: size} of every object below it."""
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
            out.update({o["Key"][len(prefix) + 1 :]: o["Size"] for o in page.get("Contents", [])})
        return out

    def read(self, uri: str) -> bytes:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def stop(self) -> None:
        self.gate.release()
        self._server.shutdown()
        self._thread.join(timeout=30)


def without_aws_settings() -> dict[str, str]:
    """The AWS_* variables of this environment, removed from it (returned, to restore them):
    the tests must never reach a developer's real account."""
    return {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("AWS_")}
